#!/usr/bin/env bash
# hbp-train launcher: sets up .venv on first use, then runs a subcommand.
#
#   ./launch.sh                     the default demo: the whole pipeline on the CPU on generated data
#   ./launch.sh test [ARGS]         the test suite's default tier (pytest ARGS): every feature, within ten minutes
#   ./launch.sh test --full [ARGS]  the whole suite: also the heavy proofs (chaos matrix, OpenCompass, benches); CI runs it
#   ./launch.sh train [OVERRIDES]   train with Hydra overrides (torchrun, or the deepspeed launcher with HOSTFILE)
#   ./launch.sh eval [ARGS]         evaluation (python -m eval.run); --setup-opencompass builds its own venv
#   ./launch.sh preprocess|pack|simulate|compare [ARGS]  python -m data_tools.<command> ARGS
#   ./launch.sh profile|calibrate|export [ARGS]          python -m hbp_train.profiler | .perf.calibrate | .export
#   ./launch.sh make-code-data [ARGS]  python -m data_tools.make_code_data: SFT chats from this Python's stdlib
#   (the same commands are in the venv as hbp-train, hbp-preprocess, hbp-pack, ..., hbp-eval, hbp-demo)
#   ./launch.sh setup               only the set-up
#   ./launch.sh wheelhouse DIR [--python-version 3.12] [--torch none]  every wheel the venv needs, for an offline node
#   ./launch.sh setup --offline DIR the set-up from such a folder, with no network (docs/gpu.md)
#   ./launch.sh help                this text (every command also takes --help)
#
# Set-up: HBP_VENV (default .venv), HBP_PYTHON (interpreter that creates the venv, default python3),
# HBP_TORCH_INDEX (a pip index for torch, e.g. https://download.pytorch.org/whl/cpu for the CPU build),
# HBP_INSTALL_FLASH_ATTN=1 to also install flash-attn on a CUDA machine; a CUDA machine also gets liger-kernel
# (requirements-liger.txt: fused decoder kernels), HBP_INSTALL_LIGER=0 to leave it out. The repo is installed in
# editable mode (pip install -e .), which also puts the hbp-* commands into the venv's bin/.
# train: NPROC (processes on this node; default: its GPUs, or 1 on a CPU), NNODES, NODE_RANK, MASTER_ADDR,
# MASTER_PORT (torchrun rendezvous across nodes), HOSTFILE (use the deepspeed launcher instead); HBP_SHUTDOWN_TIMEOUT
# (seconds a SIGTERM'd run has to finish its step and save, default 300), HBP_RDZV_TIMEOUT, HBP_RDZV_REPORT,
# HBP_HEARTBEAT, HBP_PG_TIMEOUT (how long nodes wait for each other: docs/reliability.md).
set -euo pipefail
# Paths on the command line stay relative to where you run this from; the repo is found through ROOT.
ROOT=$(cd "$(dirname "$0")" && pwd)
VENV=${HBP_VENV:-$ROOT/.venv}
PY=$VENV/bin/python
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1}
export TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1} TOKENIZERS_PARALLELISM=false

have_cuda() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
# Without a GPU, name DeepSpeed's accelerator: it would pick the CPU anyway, after a warning per process.
have_cuda || export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}

setup() {
  # The stamp holds a hash of the requirements, pyproject.toml and the repo's path: a change re-runs the install,
  # no change makes this instant.
  local stamp=$VENV/.hbp-installed want
  want=$( (cat "$ROOT/requirements.txt" "$ROOT/requirements-liger.txt" "$ROOT/pyproject.toml"; echo "$ROOT") | sha256sum | cut -c1-16)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
  if [ "${1:-}" = "--offline" ]; then setup_offline "${2:-}"; echo "$want" > "$stamp"; return 0; fi
  echo "[launch] setting up $VENV (first run: about two minutes)"
  [ -x "$PY" ] || "${HBP_PYTHON:-python3}" -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  # --no-compile: byte-compiling every installed file (torch's thousands included) is much of pip's time; Python
  # compiles the modules it imports on their first use instead.
  local pip=("$PY" -m pip install -q --no-compile)
  if ! "$PY" -c "import torch" 2>/dev/null; then
    # torch first, the build for this machine: an open range would pull the multi-GB CUDA build from PyPI.
    local index=()
    [ -n "${HBP_TORCH_INDEX:-}" ] && index=(--index-url "$HBP_TORCH_INDEX")
    if have_cuda; then
      "${pip[@]}" ${index[@]+"${index[@]}"} "torch>=2.11"     # the CUDA build
    else
      "${pip[@]}" ${index[@]+"${index[@]}"} "torch==2.13.0"   # the version the CPU tests run on
    fi
  fi
  "${pip[@]}" -r "$ROOT/requirements.txt"
  PYTHONWARNINGS=ignore::UserWarning "$PY" -m pip install -q --no-deps -e "$ROOT"   # (no editable-mode banner)
  # Venvs set up before the editable install held a .pth file pointing at the repo: no longer needed.
  rm -f "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/hbp_train_repo.pth"
  if have_cuda && [ "${HBP_INSTALL_FLASH_ATTN:-0}" = 1 ]; then
    "$PY" -m pip install -q --no-build-isolation -r "$ROOT/requirements-flash.txt" || echo "[launch] flash-attn did not build; the torch varlen backend is used instead"
  fi
  if have_cuda && [ "${HBP_INSTALL_LIGER:-1}" = 1 ]; then
    "${pip[@]}" -r "$ROOT/requirements-liger.txt" || echo "[launch] liger-kernel did not install; the decoder kernels stay eager"
  fi
  echo "$want" > "$stamp"
}

setup_offline() {
  # Everything from a folder written by `./launch.sh wheelhouse` (scripts/wheelhouse.py), nothing from the network.
  # Without a torch wheel in it, the venv sees the system's packages, so the node's own (CUDA) torch is used.
  local dir=$1 site=()
  if [ -z "$dir" ] || [ ! -d "$dir" ]; then
    echo "launch.sh: setup --offline ${dir:-(no folder)}: not a folder of wheels (write one with ./launch.sh wheelhouse DIR on a connected machine)" >&2
    exit 2
  fi
  compgen -G "$dir/torch-*.whl" >/dev/null || site=(--system-site-packages)
  echo "[launch] setting up $VENV offline from $dir${site:+ (torch from the system)}"
  [ -x "$PY" ] || "${HBP_PYTHON:-python3}" -m venv ${site[@]+"${site[@]}"} "$VENV"
  local pipi=(-q --no-index --find-links "$dir")
  "$PY" -m pip install "${pipi[@]}" setuptools wheel
  if [ ${#site[@]} -eq 0 ]; then "$PY" -m pip install "${pipi[@]}" torch; fi
  if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "launch.sh: setup --offline: no torch in $dir and none on this system (add it: ./launch.sh wheelhouse DIR --torch installed)" >&2
    exit 2
  fi
  if [ -f "$dir/node-has.txt" ]; then
    # A wheelhouse for a node's image (wheelhouse --node-has): the runtime requirements, over the image's packages.
    PYTHONWARNINGS=ignore::UserWarning "$PY" -m pip install "${pipi[@]}" --no-build-isolation -e "$ROOT"
  else
    "$PY" -m pip install "${pipi[@]}" -r "$ROOT/requirements.txt"
  fi
  # Liger's wheel (the wheelhouse adds it) on a CUDA node only; its Triton comes with the node's CUDA torch.
  if have_cuda && [ "${HBP_INSTALL_LIGER:-1}" = 1 ] && compgen -G "$dir/liger_kernel-*.whl" >/dev/null; then
    "$PY" -m pip install "${pipi[@]}" --no-deps -r "$ROOT/requirements-liger.txt"
  fi
  PYTHONWARNINGS=ignore::UserWarning "$PY" -m pip install "${pipi[@]}" --no-deps --no-build-isolation -e "$ROOT"
}

demo() {
  exec "$PY" -m hbp_train.demo "$@"
}

run_tests() {
  # Exit code 5 means pytest collected no tests: say so and fail, an empty suite is not a pass.
  cd "$ROOT"  # pytest.ini and tests/ are found from the repo root
  set +e
  "$PY" -m pytest "$@"
  local rc=$?
  set -e
  if [ $rc -eq 5 ]; then echo "[launch] pytest collected no tests"; exit 1; fi
  exit $rc
}

train() {
  # Launcher: NPROC (default: GPUs on this node, or 1 on CPU); multi-node via NNODES/NODE_RANK/MASTER_ADDR/
  # MASTER_PORT (torchrun rendezvous) or HOSTFILE (deepspeed launcher).
  local nproc=${NPROC:-}
  if [ -z "$nproc" ]; then if have_cuda; then nproc=$(nvidia-smi -L | wc -l); else nproc=1; fi; fi
  # Check the config once before starting N workers: a bad value is then one line (exit 2), not N tracebacks. Told
  # the world size (not known here for the deepspeed launcher's hosts), it also refuses what the workers would: a
  # plan of another world size, a resume whose SP degrees cannot run on it (docs/reliability.md).
  local world=$(( nproc * ${NNODES:-1} ))
  if [ -n "${HOSTFILE:-}" ]; then world=; fi
  WORLD_SIZE=$world "$PY" -m hbp_train.config "$@" >/dev/null || exit $?
  if [ -n "${HOSTFILE:-}" ]; then
    exec "$VENV/bin/deepspeed" --no_local_rank --hostfile "$HOSTFILE" --module hbp_train.train "$@"
  fi
  # The CPU threads of the node shared among the workers (torchrun's own default is 1, with a warning banner).
  local cores; cores=$(nproc)
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / nproc > 0 ? cores / nproc : 1 ))}
  # hbp_train.launch is torchrun that ends a worker's failure with one line instead of its own traceback.
  # One node without MASTER_PORT: --standalone picks a free port, so two jobs on one host never collide. A fixed
  # port only when the user sets one or runs several nodes (they must agree on it); a busy port is one line.
  if [ "${NNODES:-1}" = 1 ] && [ -z "${MASTER_PORT:-}" ]; then
    exec "$PY" -m hbp_train.launch --standalone --nproc_per_node "$nproc" -m hbp_train.train "$@"
  fi
  exec "$PY" -m hbp_train.launch --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" --nproc_per_node "$nproc" \
    --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29511}" -m hbp_train.train "$@"
}

cmd=${1:-demo}
[ $# -gt 0 ] && shift
case "$cmd" in
  help|-h|--help) sed -n '2,/^set -euo/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
  setup) setup "$@" ;;
  wheelhouse) setup; exec "$PY" "$ROOT/scripts/wheelhouse.py" "$@" ;;
  demo) setup; demo "$@" ;;
  test) setup; run_tests "$@" ;;
  train) setup; train "$@" ;;
  eval) setup; exec "$PY" -m eval.run "$@" ;;
  preprocess|pack|simulate|compare) setup; exec "$PY" -m "data_tools.$cmd" "$@" ;;
  make-code-data) setup; exec "$PY" -m data_tools.make_code_data "$@" ;;
  profile) setup; exec "$PY" -m hbp_train.profiler "$@" ;;
  calibrate) setup; exec "$PY" -m hbp_train.perf.calibrate "$@" ;;
  export) setup; exec "$PY" -m hbp_train.export "$@" ;;
  *) echo "launch.sh: unknown command '$cmd' (try ./launch.sh help)" >&2; exit 2 ;;
esac
