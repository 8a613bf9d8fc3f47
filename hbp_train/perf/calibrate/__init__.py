"""Cost-model calibration: time one decoder layer's attention by document length and its linear part.

    python -m hbp_train.perf.calibrate --model-shape llama3.2-1b --out calib_1b.json
    python -m hbp_train.perf.calibrate --model-shape llama3.2-1b --calibration calib_1b.json --validate \\
        --validate-out validate_1b.json
    OMP_NUM_THREADS=1 python -m hbp_train.perf.calibrate --device cpu --threads 1 --procs 2 --model-shape S.json \\
        --tokens 8192 --doc-lens 64,256,1024,4096,8192 --out calib_cpu.json        # for training on this CPU

Calibrate (default): one decoder layer built with transformers from the shape's config (Llama architecture,
random weights, bf16 on a GPU, fp32 on the CPU), timing the program training runs on this device
(``timing.training_program``, resolved as the trainer resolves it): the attention backend chosen for the shape's
heads (auto probes the GPU kernels), the decoder kernels of model.kernels (``--kernels``, auto: Liger on a GPU where
installed) and the LM-head loss of loss.impl (``--loss-impl``, auto: fused on a GPU, chunked on the CPU).
Attention: packs of ``--tokens`` tokens made of documents of one length each, packed varlen causal attention from
hbp_train.model.attention, timed forward and forward+backward. Linear part: the whole layer (norms, q/k/v/o
projections, RoPE, gated MLP, with the decoder kernels) fwd+bwd with the attention core replaced by a cheap
elementwise stand-in. LM head: the trainer's LM-head loss fwd+bwd over the shape's vocabulary (``time_head``). Times are medians over ``--iters`` after ``--warmup`` and
are written per 32768 tokens, the format of hbp_train/perf/calibration/h100_llama3_8b_layer.json (plus
"model_shape", and "device", "dtype", "threads", "procs").

On the CPU (``--device cpu``) the numbers are a calibration of this machine for CPU training (the trainer's fp32
and ``sdpa_block`` backend): measure with the torch threads one training rank gets (``--threads``: cores //
processes, what launch.sh sets as OMP_NUM_THREADS) and with ``--procs`` = the training processes, which measure the
same points at the same moment (a barrier before each), because ranks running side by side share caches and
memory bandwidth: a lone process on an idle machine runs faster than a training rank does.

Validate (``--validate``): builds the whole model (all layers + LM head), times fwd+bwd of packs holding
1 to ``--max-samples`` samples (random split of ``--tokens``) through the trainer's own program (the decoder, then
the LM-head loss of hbp_train/model/loss.py, never T x vocab logits), compares with CostModel.pack_time from the
calibration, prints the error per pack and writes a JSON report (the acceptance target is within 10%). It runs
the same program as the calibration (backend, decoder kernels, loss) and names it in the report. Its default
pack is the largest that fits the GPU (``validate_tokens``): 32768 tokens of an 8B shape do not fit 80 GB.

Without a GPU and without ``--device cpu`` this prints one line and exits 2.

The command's parts: cli.py (flags, --rounds, --procs), layer.py (the calibration: attention table, linear part,
LM head), validation.py (--validate on whole packs), timing.py (the timer, shared with the --procs barrier, and
what a calibration says about its device).
"""

from hbp_train.perf.calibrate.cli import build_parser, main

__all__ = ["build_parser", "main"]
