"""Hub-ready DAMCHA checkpoints: model cards, one-call checkpoint folders, and pushing them to the Hub.

    from damcha_hf.hub import save_hub_checkpoint, push_checkpoint

    # At the end of training (e.g. in a recipe):
    save_hub_checkpoint(
        model, "runs/my-damcha/hub",
        tokenizer_or_processor=tokenizer,          # or an image processor; saved next to the weights
        log_history=trainer.state.log_history,     # training details, results and a loss curve in the card
        base_model="openai-community/gpt2",        # when converted from a pretrained MHA model
        datasets=["wikitext"],
    )
    push_checkpoint("runs/my-damcha/hub", "your-name/my-damcha", private=True)   # or: damcha-hf push ...

`save_hub_checkpoint` writes, atomically (a temporary folder beside `folder`, then a rename), the safetensors weights,
`config.json` with an `auto_map` for every Auto class of the family, the model code (remote code: it loads with
`trust_remote_code=True` where damcha_hf is not installed), the tokenizer or image processor, a `README.md` model
card, a loss curve and a heatmap of the learned cross-head metric. `push_checkpoint` uploads exactly those files,
never optimizer or trainer state.

The package has one module per job:

    training_log        a Trainer's log history: losses and evaluations for the card, the loss-curve plot
    model_card          `build_model_card`: metadata, DAMCHA settings, loading snippets, training details, results
    checkpoint_folder   `save_hub_checkpoint`: the whole folder, written in a staging folder and renamed into place
    push                `upload_plan` (what a push uploads, only regular files inside the folder) and `push_checkpoint`
    file_rules          the files of a Hub checkpoint, and what of a dataset's name a public card may show
"""

from ..safe_files import METRIC_HEATMAP_FILE
from .checkpoint_folder import save_hub_checkpoint
from .file_rules import LOSS_CURVE_FILE
from .model_card import CITATION_BIBTEX, PAPER_TITLE, REPO_PLACEHOLDER, build_model_card, generator_share
from .push import HubPushError, check_can_push, push_checkpoint, upload_plan
from .training_log import TrainingLog, parse_log_history, write_loss_curve

__all__ = [
    "HubPushError",
    "build_model_card",
    "parse_log_history",
    "push_checkpoint",
    "save_hub_checkpoint",
    "upload_plan",
    "write_loss_curve",
    # Also used by the CLI, the recipes and the tests:
    "CITATION_BIBTEX",
    "LOSS_CURVE_FILE",
    "METRIC_HEATMAP_FILE",
    "PAPER_TITLE",
    "REPO_PLACEHOLDER",
    "TrainingLog",
    "check_can_push",
    "generator_share",
]
