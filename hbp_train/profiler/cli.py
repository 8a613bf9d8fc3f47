"""`python -m hbp_train.profiler [OVERRIDES...]`: profile, choose the packing groups, write profile.json.

Thin entry point: reads the run config (the trainer's, with profile.* overrides), builds the model shape, the cost
model, a measurement back-end and the launcher of the SP > 1 measurements (one torchrun per degree this node has
devices for, launcher.py), runs hbp_train.profiler.search.Profiler, prints the report and writes the file
``data_tools.pack --groups auto --profile profile.json`` reads. A user mistake (UserError) is one line, exit 2.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict
from typing import Optional

from hbp_train.common.errors import EXIT_USER_ERROR, UserError
from hbp_train.common.outputs import check_output_file, interrupted, write_output
from hbp_train.perf.cost_model import CostModel
from hbp_train.perf.memory import JobSettings
from hbp_train.perf.shape import ModelShape, model_shape_of, sp_heads_problem
from hbp_train.profiler.backends import AnalyticBackend
from hbp_train.profiler.gpu_backend import GpuBackend
from hbp_train.perf.profile_config import ProfileConfig
from hbp_train.profiler.launcher import SpLauncher, launched_degrees, measuring_devices
from hbp_train.profiler.report import format_table
from hbp_train.profiler.search import Profiler
from hbp_train.profiler.zero_choice import ZeroChoice, candidate_setups

log = logging.getLogger(__name__)

HELP = """usage: python -m hbp_train.profiler [OVERRIDES...]
       python -m hbp_train.profiler --max-context --model MODEL --gpus N [--gpu-memory-gb 80] ...  (--max-context -h)

Auto group selection (HBP Alg. 1/3/4): profile (SP degree, checkpointed layers) for each candidate pack length and
write the packing groups to profile.json for `python -m data_tools.pack --groups auto --profile profile.json`.
The config is the trainer's (conf/config.yaml, Hydra overrides): model=..., deepspeed=... (ZeRO stage, optimizer
offload), loss.chunk_size=..., and the profile.* fields below.

profile.* options (defaults in brackets):
  max_len [131072]          longest pack length (the longest training sample): l_max
  min_len [8192]            shortest candidate; candidates = powers of two in [min_len, max_len] + max_len
                            (the default is lowered to max_len when max_len is shorter, with a note)
  lengths [[]]              explicit candidate lengths instead (e.g. profile.lengths=[4096,8192,16384])
  world_size [8]            GPUs of the training job: SP degrees = powers of two dividing it; ZeRO shards over it
  sp_degrees [[]]           SP degrees to try (default all of the above)
  gpus_per_node [8]         SP groups larger than a node use the inter-node bandwidth (comm model)
  headroom [0.9]            fraction of device memory a configuration may use
  memory_metric [nvml]      nvml (device used memory, as the paper) or torch (peak allocated)
  ckpt_probe_layers [null]  the 'fewer checkpointed layers' probe of Alg. 4 (null = half the layers)
  warmup_iters [1] iters [3]  untimed and timed fwd+bwd iterations per measurement (median recorded)
  time_budget_s [300]       stop starting measurements after this; choose from what was measured
  prune [true]              skip larger SP for a length once one needs no checkpointing
  docs [single]             synthetic pack: one document, or a tokenized dataset dir / .npy/.json/.txt lengths
  seed [0]                  seed for document lengths and token ids
  dry_run [false]           no GPU: analytic estimate (cost model + memory model), labelled "analytic"
  calibration ['']          cost-model calibration JSON (default: the shipped H100 one, scaled to the model)
  device_memory_gb [80]     device memory assumed by dry_run and device=cpu: the card's size (80GB H100: 80), GiB
  device [cuda]             cuda, or cpu (the real model on this CPU, gloo: groups for training on it)
  measure_devices [null]    devices that measure SP > 1 together, one torchrun per degree (null = the CUDA
                            devices present; device=cpu: 1); larger degrees are estimated
  worker_timeout_s [600]    a measuring torchrun is stopped this long after the time budget; its rest estimated
  levers [true]             search the memory levers per length: tiled MLP, activation offload (with checkpointing)
  zero_stages [[1,2,3]]     ZeRO stages to choose the run's among (longest packs first, then fastest); [] = the
                            job's deepspeed.zero_stage only; the plan names the chosen stage
  zero_offload [false]      also consider optimizer offload (and ZeRO-3 with parameter offload)
  global_tokens [4194304]   tokens per optimizer step: ZeRO's per-step costs are spread over its micro-batches
  comm_overlap [0]          share of ZeRO's per-micro-batch collectives hidden behind compute
  pcie_gbps [null]          host <-> GPU GB/s per GPU for the offloads (null: 25)
  output [profile.json]     where to write the profile
  progress [true]           tqdm progress bar

Without a GPU and without profile.dry_run=true: one line and exit code 2. Bad values: one line naming the field,
exit code 2; so does a profile where nothing fits. A dry run needs only the model's config.json
(model.name_or_path=DIR holding it; without a tokenizer the config's vocab_size is used), or a preset with a
published shape (model=qwen3_8b, ...: docs/models.md), and no data.shards, e.g.
  python -m hbp_train.profiler experiment=llama3_8b_128k model.name_or_path=DIR profile.dry_run=true
--max-context answers "how long can I go?": the longest sample N GPUs train, each memory lever added in turn
(baseline, + SP over all GPUs, + checkpointing, + tiled loss, + tiled MLP, + offload), the ZeRO stage named, with
the predicted step time; modelled, nothing runs (hbp-profile --max-context --help).
See docs/profiler.md.
"""


def tokenizer_vocab(tokenizer_dir: str, dry_run: bool) -> Optional[int]:
    """The tokenizer's vocabulary size (what build_model sizes the embeddings by). A dry run without a loadable
    tokenizer uses the model config's vocab_size (warned); a GPU run needs it (UserError naming the field)."""
    from transformers import AutoTokenizer

    try:
        return len(AutoTokenizer.from_pretrained(tokenizer_dir))
    except (OSError, ValueError) as e:  # what transformers raises for a folder without a (readable) tokenizer
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if not dry_run:
            raise UserError(f"model.tokenizer: cannot load a tokenizer from {tokenizer_dir!r} ({reason}); set "
                            "model.tokenizer=DIR (e.g. data_tools/assets/tokenizer)") from None
        log.warning("model.tokenizer: no tokenizer in %r; the dry run uses the model config's vocab_size",
                    tokenizer_dir)
        return None


def usable_sp_degrees(candidates: list[int], shape: ModelShape) -> list[int]:
    """The SP degrees Ulysses can split this model's heads by (perf.shape.sp_heads_problem); logs the others."""
    usable = []
    for sp in candidates:
        problem = sp_heads_problem(shape.num_heads, shape.num_kv_heads, sp)
        if problem is None:
            usable.append(sp)
        else:
            log.warning("skipping %s", problem.split(":")[0])
    return usable


def default_min_len_override(overrides: list) -> Optional[str]:
    """``profile.min_len=<max_len>`` when min_len is left at its default and profile.max_len is shorter (a profile
    of shorter packs than the default's 8192 tokens), after a one-line note; None otherwise. A min_len set on the
    command line is the user's: above max_len it stays an error."""
    if any(o.lstrip("+~").startswith("profile.min_len=") for o in overrides):
        return None
    from hbp_train import config as run_config

    try:
        profile = run_config.compose(overrides).profile
        max_len, min_len = int(profile.max_len), int(profile.min_len)
    except Exception:  # noqa: BLE001 -- a bad override or value: config.load reports it in its own words
        return None
    default = ProfileConfig.min_len
    if min_len != default or max_len >= min_len or max_len < 1:
        return None
    log.info("profile.min_len: the default %d is longer than profile.max_len=%d; using min_len=%d",
             default, max_len, max_len)
    return f"profile.min_len={max_len}"


def main(argv: Optional[list] = None, on_measurement=None) -> int:
    """The command; ``on_measurement(Measurement)`` is called after each measurement (bench/gpu/checks.py keeps them
    for a run stopped from outside)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--max-context" in argv:  # "how long can I go?": its own flags (max_context.py)
        from hbp_train.profiler.max_context import main as max_context

        return max_context([a for a in argv if a != "--max-context"])
    if any(a in ("-h", "--help") for a in argv):
        print(HELP, end="")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return profile(argv, on_measurement)
    except UserError as e:
        print(f"profile: {str(e).splitlines()[0]}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:  # profile.json is written only at the end, in one atomic move
        return interrupted("profile", "profile.output was left as it was")


def profile(argv: list, on_measurement=None) -> int:
    """The CLI's work: config, model shape, back-end, the search, the report and profile.json."""
    t0 = time.monotonic()
    from hbp_train import config as run_config

    overrides = run_config.user_overrides(argv)
    if not any(o.lstrip("+~").startswith("data.shards=") for o in overrides):
        # The profiler reads no data (it runs before packing), but presets such as experiment=llama3_8b_128k
        # leave data.shards required.
        overrides.append("data.shards=unused-by-profiler")
    clamp = default_min_len_override(overrides)
    if clamp:
        overrides.append(clamp)
    try:
        run = run_config.load(overrides)
    except run_config.ConfigError as e:
        hint = ""
        if str(e).startswith("model.name_or_path"):
            hint = ("; the profiler needs only the model's config.json (plus a tokenizer, or model.tokenizer=DIR): "
                    "point model.name_or_path (or HBP_MODEL_DIR) at a directory holding it")
        raise UserError(f"config error: {e}{hint}") from None
    pcfg: ProfileConfig = run.profile
    job = JobSettings.of_run(run)
    if not pcfg.dry_run and pcfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UserError("no CUDA GPU found: the profiler measures on a GPU; add profile.dry_run=true for the "
                            "analytic estimate from the model config and the calibration")
    check_output_file("profile.output", pcfg.output)  # now, not after the profiling
    vocab = tokenizer_vocab(run.model.tokenizer, pcfg.dry_run)
    shape = model_shape_of(run.model, vocab)
    cost_model = CostModel.from_calibration(pcfg.calibration or None, model_shape=shape)
    if pcfg.dry_run:
        backend = AnalyticBackend(shape, pcfg, cost_model, job)
    else:
        try:
            backend = GpuBackend(run.model, pcfg, cost_model, job, vocab_size=vocab,
                                 device="cpu" if pcfg.device == "cpu" else None, loss_impl=run.loss.impl)
        except OSError as e:  # the weights under model.name_or_path are missing or unreadable
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"model.name_or_path: cannot load the model ({reason}); a GPU profile needs the "
                            "weights, a dry run (profile.dry_run=true) only config.json") from None
    if pcfg.device == "cpu" and not pcfg.dry_run:
        log.warning("profile.device=cpu: times and memory of this CPU, groups for training on it (profile on the "
                    "GPUs to plan a GPU job)%s", "" if pcfg.calibration else "; profile.calibration is the shipped "
                    "GPU one: SP degrees estimated from it are a GPU's (calibrate this CPU with python -m "
                    "hbp_train.perf.calibrate --device cpu)")
    sp_degrees = usable_sp_degrees(pcfg.sp_candidates(), shape)
    devices = measuring_devices(pcfg)
    launcher = SpLauncher(overrides, pcfg, launched_degrees(sp_degrees, devices, pcfg.gpus_per_node), vocab,
                          backend.device_memory_bytes)
    if launcher.degrees:
        log.info("measuring sp=%s on this node's devices (one torchrun each; logs in %s)",
                 ",".join(map(str, launcher.degrees)), launcher.run_dir)
    setup_s = time.monotonic() - t0
    zero = ZeroChoice(candidate_setups(pcfg, job), job, shape, pcfg)
    profiler = Profiler(backend, pcfg, sp_degrees=sp_degrees, launcher=launcher, zero=zero,
                        on_measurement=on_measurement)
    out = profiler.run()  # ProfileError (a UserError) when nothing fits
    out["hardware"] = backend.hardware()
    out["model"] = {**asdict(shape), "num_params": getattr(backend, "params", shape.num_params)}
    out["hardware"]["measure_devices"] = devices
    out["job"] = {"world_size": pcfg.world_size, **asdict(job)}
    if "zero" in out:  # the settings the groups were chosen for: the job's, at the chosen ZeRO setup
        chosen = next(z for z in zero.setups if z.as_dict().items() <= out["zero"].items())
        out["job"].update(asdict(chosen.job(job)))
    out["config"] = asdict(pcfg)
    out["profiler"]["setup_s"] = round(setup_s, 3)
    out["profiler"]["total_s"] = round(time.monotonic() - t0, 3)
    if pcfg.dry_run:
        # What the same profile would spend measuring on a GPU node (iterations only: no model build, no OOM
        # cost). A degree up to the node's GPUs (measure_devices, else gpus_per_node) runs on sp GPUs at its own
        # time; a larger one runs as its l/sp slice on one GPU: about time/sp of the SP configuration.
        node = min(pcfg.measure_devices or pcfg.gpus_per_node, pcfg.gpus_per_node)
        out["profiler"]["predicted_gpu_measure_s"] = round(sum(
            (pcfg.warmup_iters + pcfg.iters) * m["time_s"] / (1 if m["sp"] <= node else m["sp"])
            for m in out["measurements"] if m["time_s"]), 1)
    write_output("profile.output", pcfg.output, lambda p: p.write_text(json.dumps(out, indent=1) + "\n"))
    print(format_table(out))
    print(f"wrote {pcfg.output}: use it with  python -m data_tools.pack --groups auto --profile {pcfg.output} "
          f"--world-size {pcfg.world_size} ...")
    return 0
