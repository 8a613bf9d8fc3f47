#!/usr/bin/env bash
# The offline install's round trip on this machine: write the wheelhouse, install it into a fresh venv with no
# index (pip never sees the network), import every package the trainer uses, run the GPU acceptance dry run.
#
#   scripts/check_offline_install.sh [WORKDIR]       (default: a temporary folder, removed at the end)
#
# Needs a set-up .venv (./launch.sh setup) and network for the wheelhouse step only. Prints the time of each stage.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-$(mktemp -d)}
[ $# -gt 0 ] || trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK"
stage() { echo "[offline] $1: $(( $(date +%s) - T0 )) s"; T0=$(date +%s); }
T0=$(date +%s)
"$ROOT/launch.sh" wheelhouse "$WORK/wheels"
stage "wheelhouse"
# pip must not reach an index or this machine's own wheel folders: only the wheelhouse.
env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 HBP_VENV="$WORK/venv" \
  "$ROOT/launch.sh" setup --offline "$WORK/wheels"
stage "setup --offline"
HBP_VENV="$WORK/venv" "$WORK/venv/bin/python" - <<'EOF'
import importlib
for name in ("torch", "deepspeed", "transformers", "accelerate", "peft", "datasets", "tokenizers", "safetensors",
             "numpy", "pyarrow", "hydra", "omegaconf", "pynvml", "tqdm", "matplotlib", "tensorboard", "pytest",
             "hypothesis", "hbp_train.trainer", "hbp_train.build", "data_tools.pack", "eval.run"):
    importlib.import_module(name)
print("[offline] every package imports")
EOF
stage "imports"
"$WORK/venv/bin/python" "$ROOT/bench/gpu_acceptance.py" --dry-run --out "$WORK/acceptance" >/dev/null
echo "[offline] acceptance dry run: $(grep -c '"seconds"' "$WORK/acceptance/acceptance.json") checks reported"
stage "acceptance dry run"
