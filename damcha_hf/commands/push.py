"""`damcha-hf push`: upload a DAMCHA checkpoint to the Hub (weights, config, code, preprocessor, card, images)."""

import argparse

from damcha_hf.argument_checks import HelpFormatter


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "push",
        formatter_class=HelpFormatter,
        help="upload a checkpoint to the Hugging Face Hub (safetensors, config, code, preprocessor, card, images)",
        description="Create the Hub model repository REPO_ID if needed and upload the checkpoint's safetensors "
        "weights, config, model code, tokenizer or image processor, README.md and its images; optimizer, scheduler, "
        "RNG and trainer state are never uploaded.",
    )
    parser.add_argument("checkpoint", help="a checkpoint folder (save_pretrained / damcha_hf.hub.save_hub_checkpoint)")
    parser.add_argument("repo_id", help="the Hub repository, 'namespace/name'")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--revision", help="push to this branch (created if missing) instead of main")
    parser.add_argument(
        "--token",
        help="a Hub token with write access; prefer the HF_TOKEN environment variable or `hf auth login` (the "
        "default), since a token on the command line stays in the shell history and the process list",
    )
    parser.add_argument("--commit-message", default="Upload DAMCHA checkpoint", help="the Hub commit's message")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from damcha_hf.hub import push_checkpoint, upload_plan

    # A HubPushError (offline, no token, a network failure, an unsafe folder) becomes one line and exit code 2.
    url = push_checkpoint(
        args.checkpoint,
        args.repo_id,
        private=args.private,
        revision=args.revision,
        token=args.token,
        commit_message=args.commit_message,
    )
    print("uploaded: " + ", ".join(upload_plan(args.checkpoint)))
    print(url)
    return 0
