#!/usr/bin/env bash
# The compile-only GPU environment: the GPU machines' jax (0.11.2, CUDA 13) on this CPU machine, so
# that `python -m megascale_jax.plan --compile` compiles the real train step for an H100/H200 with
# no GPU and no driver (docs/compile.md; measured facts in the design notes' AOT page).
#
#   bash configs/aot/setup_env.sh          # creates or checks the environment; idempotent
#
# Where: $MEGASCALE_AOT_VENV, default ~/.cache/megascale_jax/aot-venv (outside the checkout, so
# every clone on a machine shares one ~2.3 GB environment). What goes in:
#   * jax/jaxlib 0.11.2 (needs Python >= 3.12: python3.12 on PATH, or pyenv's 3.12),
#   * the CUDA 13 plugin wheels with --no-deps (no nvidia-* runtime wheels: nothing runs),
#   * nvidia-cudnn-cu13, which jax checks while tracing cuDNN attention (model.attention=cudnn),
#   * ptxas and libdevice: a CUDA 13 toolkit's if the machine has one, else the PyPI wheels,
#   * the project's dependencies (this checkout, editable), not torch (interop is not needed).
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
venv=${MEGASCALE_AOT_VENV:-$HOME/.cache/megascale_jax/aot-venv}
jax_version=0.11.2
stamp="$venv/.megascale_aot_$jax_version"

if [[ -f "$stamp" ]]; then
    # Made already (by any checkout: `plan --compile` puts its own checkout first on PYTHONPATH).
    echo "compile-only environment ready: $venv/bin/python (jax $jax_version)"
    exit 0
fi

python312=""
for candidate in python3.12 "$HOME/.pyenv/versions/3.12.1/bin/python" /root/.pyenv/versions/3.12.1/bin/python; do
    # (a pyenv shim answers `command -v` without being runnable: ask it for its version instead)
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
        python312=$candidate; break
    fi
done
if [[ -z "$python312" ]]; then
    echo "setup_env.sh: jax $jax_version needs Python 3.12; install it (e.g. 'pyenv install 3.12') and rerun" >&2
    exit 2
fi

rm -rf "$venv"
"$python312" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
"${pip[@]}" --upgrade pip
printf 'jax==%s\njaxlib==%s\n' "$jax_version" "$jax_version" > "$venv/constraints.txt"
"${pip[@]}" -c "$venv/constraints.txt" "jax==$jax_version" "jaxlib==$jax_version"
"${pip[@]}" --no-deps "jax-cuda13-plugin==$jax_version" "jax-cuda13-pjrt==$jax_version"
"${pip[@]}" --no-deps nvidia-cudnn-cu13
if ! ls /usr/local/cuda*/bin/ptxas >/dev/null 2>&1; then
    "${pip[@]}" --no-deps nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88
fi
"${pip[@]}" -c "$venv/constraints.txt" -e "$here"
"$venv/bin/python" - <<'PY'
import jax, jaxlib
from jax.experimental import topologies  # noqa: F401  (the deviceless compile's entry point)
assert jax.__version__ == jaxlib.__version__, (jax.__version__, jaxlib.__version__)
PY
touch "$stamp"
echo "compile-only environment ready: $venv/bin/python (jax $jax_version)"
