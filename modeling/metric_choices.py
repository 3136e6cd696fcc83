"""The values DAMCHA's metric fields take, and the backends of the `"query"` context: one home for the declaration
(`variant_damcha.py`), which is torch-free, and the math (`metric.py`), which names them in its refusals, so that
neither file imports the other to read them.

Part of the remote-code payload: imports nothing.
"""

METRIC_CONTEXTS = ("token", "sequence", "query")
METRIC_MASKS = ("full", "diagonal", "offdiagonal")
METRIC_FORMS = ("keys", "scores")
METRIC_SHARINGS = ("stack", "layer")
METRIC_INPUT_NORMS = ("none", "layernorm")
# The expanded `"query"` query is wider than the value heads: only eager attention and SDPA take it.
QUERY_CONTEXT_BACKENDS = ("eager", "sdpa")
