"""DAMCHA model definitions, installed as `damcha_hf.modeling`.

These files are also the Hub remote-code payload: they import only torch, transformers and each other (single-dot
relative imports), so `save_pretrained` copies those a model runs next to the weights (its family's, its variant's and
the shared core: `checkpoint_code.py`) and `trust_remote_code=True` loads a checkpoint where damcha_hf is not installed. Import the models from `damcha_hf`, which also registers them.
"""
