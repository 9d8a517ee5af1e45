"""Export a run's model to Hugging Face's GPT-2 format: `python scripts/export_hf.py RUN_DIR HF_DIR` writes config.json
and model.safetensors (GPT2LMHeadModel.from_pretrained(HF_DIR)), not the tokenizer. Needs transformers; models with
activation=relu2, pos_emb=rope or an attn_window have no GPT-2 equivalent."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.config import fail  # noqa: E402
from common.errors import UserError  # noqa: E402
from common.files import CKPT_NAME  # noqa: E402
from model.checkpoint import load_checkpoint  # noqa: E402
from model.hf_gpt2 import hf_from_gpt  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a train.py run directory, holding ckpt.pt")
    parser.add_argument("hf_dir", metavar="HF_DIR", type=Path, help="where to write the HF model (created if missing)")
    args = parser.parse_args(argv)
    if args.hf_dir.exists() and not args.hf_dir.is_dir():  # save_pretrained would only log an error
        parser.error(f"HF_DIR {args.hf_dir} is a file; pass a directory")
    try:
        model = load_checkpoint(args.run_dir / CKPT_NAME).build_model()
        hf_from_gpt(model.eval()).save_pretrained(args.hf_dir)
    except UserError as err:
        fail(str(err))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    config = model.config
    print(f"wrote {args.hf_dir}: GPT-2 with {config.n_layer} layers, {config.n_head} heads, width {config.n_embd}, "
          f"context {config.block_size}, vocabulary {config.vocab_size}")


if __name__ == "__main__":
    main()
