"""What is trained: the Hugging Face model, its packed attention, its kernels and its loss.

hf_model.py the model config and build (weights, per-layer checkpointing) · attention.py the packed attention as
transformers calls it · attention_backends.py its backends (windows, soft-caps) · attention_kernels.py the kernels'
imports · attention_flex.py FlexAttention's pack mask · attention_calls.py what a model's layers ask of their
attention (meta device) · attention_setup.py which backend runs (probe, selection) and installing it on a model ·
kernels.py fused or compiled decoder kernels (Liger, torch.compile) · liger_probe.py each Liger kernel tried on the
device before use · levers.py the memory levers of a packing group (tiled MLP, activation offload) · packed_lm.py
the module DeepSpeed trains (the model and its LM-head loss in one forward) · loss.py the LM-head cross-entropy and its
normalisers · ulysses.py DeepSpeed-Ulysses sequence parallelism around the attention (split, loss across the SP
group) · rope.py per-sample RoPE (a length-dependent RoPE from each sample's own length) · moe.py the MoE
router loss · lora.py LoRA/DoRA through peft · families.py the tested families · compat.py what the packed path
refuses up front.

May import: distributed (process groups), planning and perf's cost models (shapes), common. Never the loop, the
batches, the run folder or observation: a model is built and run the same way by the trainer, the profiler, the
calibration and the benches.
"""
