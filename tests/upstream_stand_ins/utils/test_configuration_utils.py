"""Stand-in for transformers' `tests/utils/test_configuration_utils.py`, which the sdist does not ship.

`ConfigTester.check_config_arguments_init` builds a config from `config_common_kwargs` (fields every
`PreTrainedConfig` has, at values other than their defaults) and checks that each one is kept. This is our own set of
such fields.
"""

config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "tie_word_embeddings": False,
    "chunk_size_feed_forward": 5,
    "architectures": ["BertModel"],
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "problem_type": "regression",
}
