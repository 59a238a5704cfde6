"""`python -m megascale_jax.export_hf RUN_DIR OUT_DIR [--step N] [--dtype float32|bfloat16] [--overwrite] [--max-shard-gb G]`

Writes a run's newest committed checkpoint (or step N) as a Hugging Face model directory that
`transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` and `AutoTokenizer` load with no
custom code (`megascale_jax.interop.hf_export`). A config with no exact HF architecture is refused
with the option that blocks it; an OUT_DIR that holds a model is kept unless --overwrite.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Optional, Sequence

from megascale_jax import cli
from megascale_jax.config import ConfigError


def parse_args(argv):
    parser = cli.ArgumentParser(prog="python -m megascale_jax.export_hf",
                                     description="Export a run's checkpoint as a Hugging Face model directory.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the --run-dir of a training run")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="directory for config.json, safetensors and tokenizer")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest committed)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the weights' type: float32 (the run's own, exactly) or bfloat16 (half the size)")
    parser.add_argument("--overwrite", action="store_true", help="replace a model already in OUT_DIR")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="split the weights into shards of at most this size")
    return cli.parse(parser, argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    missing = [p for p in ("safetensors", "tokenizers", "huggingface_hub") if importlib.util.find_spec(p) is None]
    if missing:
        return cli.user_error(f"python -m megascale_jax.export_hf needs {', '.join(missing)}; pip install -e '.[interop]'")
    if args.max_shard_gb <= 0:
        return cli.user_error(f"--max-shard-gb {args.max_shard_gb} must be > 0")
    from megascale_jax.interop import hf_export

    try:
        done = hf_export.export(args.run_dir, args.out_dir, args.step, args.overwrite, int(args.max_shard_gb * 1e9),
                                args.dtype)
    except (ConfigError, hf_export.ExportError, OSError) as e:
        return cli.user_error(e)
    print(f"exported step {done['step']} of {args.run_dir} as {done['architecture']} "
          f"({done['parameters'] / 1e6:.2f}M parameters, {args.dtype}) to {args.out_dir}: {', '.join(done['files'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
