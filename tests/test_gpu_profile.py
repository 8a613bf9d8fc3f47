"""bench/gpu/step_profile.py: the categoriser maps real kernel names right, the categories of a real profiler trace cover
its whole kernel time (a tiny model's step on the CPU), and the command writes its table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bench.gpu.step_profile as gp

REPO = Path(__file__).resolve().parent.parent

# Kernel names as CUDA traces of training steps show them (cuBLAS/CUTLASS on Hopper and Ampere, FlashAttention 2/3/4,
# cuDNN SDPA, inductor's Triton kernels, Liger's, NCCL, the runtime's copies, ATen's elementwise/reduce/optimizer).
CUDA_KERNELS = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x"
    "_cublas": "gemm",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>"
    "(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)": "gemm",
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT": "gemm",
    "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn": "gemm",
    "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, cutlass::bfloat16_t, "
    "Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, false, "
    "false>(flash::Flash_fwd_params)": "attention",
    "void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8, 2, 4, 2, "
    "false, false, cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 8, cutlass::bfloat16_t> >, false, true, "
    "false, false, false, false, false, false>(flash::Flash_bwd_params)": "attention",
    "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90"
    "<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cute::tuple<cute::C<128>, cute::C<128>, cute::C<64> >, "
    "64, cutlass::bfloat16_t, float, cutlass::arch::Sm90, true, false, false, true, false, false, true, true, false, "
    "false, false, false>>>>(flash::FlashAttnFwdSm90<...>::Params)": "attention",
    "kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at__tensorptrbf16gmemalign16"
    "odiv8_0": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0_0": "attention",
    "triton_tem_fused_flex_attention_0": "attention",
    "triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0": "elementwise",  # an inductor-fused RMSNorm
    "triton_poi_fused_mul_silu_1": "elementwise",  # an inductor-fused SwiGLU
    "_rms_norm_forward_kernel": "elementwise",  # Liger's
    "_triton_rope": "elementwise",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)": "collective",
    "ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)": "collective",
    "Memcpy HtoD (Pageable -> Device)": "memcpy",
    "Memcpy DtoH (Device -> Pinned)": "memcpy",
    "Memcpy DtoD (Device -> Device)": "memcpy",
    "Memset (Device)": "memcpy",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
    "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)": "elementwise",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
    "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
    "unsigned int, float, 4, 4> >(at::native::ReduceOp<...>)": "elementwise",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::"
    "{lambda()#3}::operator()() const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul>, 4>(...)": "elementwise",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
    "(at::native::ADAM_MODE)1, false>, double*, double, double, double, double, double, bool, float*, float*>"
    "(...)": "optimizer",
    "void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float, float, float>, float, float, float, "
    "float, float, float, adamMode_t, float>(...)": "optimizer",  # DeepSpeed's FusedAdam
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
    "namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)": "loss",
    "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>(...)": "loss",
}
CPU_OPS = {"aten::mm": "gemm", "aten::addmm": "gemm", "aten::bmm": "gemm",
           "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
           "aten::_fused_adamw_": "optimizer", "aten::_foreach_norm": "optimizer", "gloo:all_reduce": "collective",
           "c10d::allreduce_": "collective", "aten::_log_softmax": "loss", "aten::mul": "elementwise",
           "aten::copy_": "elementwise"}


@pytest.mark.parametrize("name, category", [*CUDA_KERNELS.items(), *CPU_OPS.items()])
def test_kernel_names_map_to_their_category(name, category):
    assert gp.kernel_category(name) == category


def test_scope_decides_over_the_name_but_never_for_collectives_and_copies():
    work = [{"name": "nvjet_tst_128x256", "dur_us": 100.0, "scope": "loss"},  # the LM head's GEMM: loss
            {"name": "nvjet_tst_128x256", "dur_us": 300.0, "scope": None},  # a decoder GEMM
            {"name": "Memcpy DtoD (Device -> Device)", "dur_us": 20.0, "scope": "optimizer"},
            {"name": "ncclDevKernel_AllGather", "dur_us": 30.0, "scope": "optimizer"},
            {"name": "vectorized_elementwise_kernel", "dur_us": 50.0, "scope": "optimizer"},
            {"name": "triton_poi_fused_mul_silu_1", "dur_us": 40.0, "scope": "attention"}]
    table = gp.categorise(work, wall_us=600.0, busy_us=520.0)
    assert table["ms"] == pytest.approx({"gemm": 0.3, "attention": 0.04, "elementwise": 0.0, "loss": 0.1,
                                         "optimizer": 0.05, "collective": 0.03, "memcpy": 0.02, "idle": 0.08})
    assert table["kernel_ms"] == pytest.approx(0.54) and table["overlap_ms"] == pytest.approx(0.02)
    # the categories (without idle) are the kernel time; with idle they are the wall time plus what overlapped
    assert sum(v for c, v in table["ms"].items() if c != "idle") == pytest.approx(table["kernel_ms"])
    assert sum(table["ms"].values()) == pytest.approx(table["wall_ms"] + table["overlap_ms"])


def _tiny_profile():
    """A real torch.profiler trace of two steps of a tiny HF Llama (HF loss, AdamW), with step_profile's ranges."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hbp_train.model.families import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **tiny_config("llama"), vocab_size=512),
                                             attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 512, (1, 96))

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        with torch.profiler.record_function(gp.OPTIMIZER_SCOPE):
            optimizer.step()
            optimizer.zero_grad()

    with gp._ranges(model, model.base_model, "sdpa"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                with torch.profiler.record_function(gp.STEP_SCOPE):
                    step()
    return prof


def test_the_categories_of_a_real_trace_cover_its_whole_op_time():
    prof = _tiny_profile()
    work, wall_us, busy_us = gp.work_from_profile(prof, "cpu")
    table = gp.categorise(work, wall_us, busy_us)
    # every op's self time (what the profiler's own summary totals, our ranges apart) is in exactly one category
    total_us = sum(e.self_cpu_time_total for e in prof.key_averages() if not e.key.startswith(("hbp/", "Optimizer.")))
    assert table["kernel_ms"] == pytest.approx(total_us / 1e3, rel=1e-6)
    assert sum(v for c, v in table["ms"].items() if c != "idle") == pytest.approx(table["kernel_ms"])
    assert table["ms"]["idle"] == pytest.approx(max(table["wall_ms"] - table["kernel_ms"], 0.0), abs=1e-6)
    for category in ("gemm", "attention", "loss", "optimizer", "elementwise"):
        assert table["ms"][category] > 0, category
    loss_ops = {k["name"] for k in table["top_kernels"]["loss"]}
    assert "aten::mm" in loss_ops  # the LM head's matmul, forward and backward, counts as loss, not gemm
    assert any("backward" in k["name"].lower() for k in table["top_kernels"]["attention"])  # backward via its forward


@pytest.mark.slow
@pytest.mark.full  # the acceptance dry run profiles in the default tier
def test_cpu_command_profiles_hf_and_ours_and_writes_the_table(tmp_path):
    """The command as a user runs it (its own process: one torch.distributed world and DeepSpeed's groups)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "step_profile.py"), "--device", "cpu", "--out",
                           str(tmp_path), "--steps", "2", "--warmup", "1"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "profile.json").read_text())
    assert list(result["paths"]) == ["hf_sdpa", "ours"]  # ours_eager only when ours runs fused kernels
    for name, table in result["paths"].items():
        assert "error" not in table, name
        assert set(table["ms"]) == set(gp.CATEGORIES)
        assert sum(v for c, v in table["ms"].items() if c != "idle") == pytest.approx(table["kernel_ms"])
        assert table["ms"]["loss"] > 0 and table["ms"]["optimizer"] > 0 and table["ms"]["attention"] > 0
    assert result["paths"]["ours"]["decoder_kernels"].startswith("none")
    md = (tmp_path / "profile.md").read_text()
    assert "| category | hf_sdpa | ours |" in md and all(f"| {c} |" in md for c in gp.CATEGORIES)
    assert md in proc.stdout and "[model] attention: sdpa_block" in proc.stdout


@pytest.mark.gpu
def test_gpu_trace_of_a_tiny_model_categorises_every_kernel():
    from transformers import AutoConfig, AutoModelForCausalLM

    from hbp_train.model.families import tiny_config

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **tiny_config("llama"), vocab_size=512),
                                             attn_implementation="sdpa").cuda()
    ids = torch.randint(0, 512, (1, 256), device="cuda")
    with gp._ranges(model, model.base_model, "sdpa"):
        with torch.profiler.profile() as prof:
            with torch.profiler.record_function(gp.STEP_SCOPE):
                torch.cuda.synchronize()
                model(input_ids=ids, labels=ids).loss.backward()
                torch.cuda.synchronize()
    work, wall_us, busy_us = gp.work_from_profile(prof, "cuda")
    table = gp.categorise(work, wall_us, busy_us)
    assert work and table["ms"]["gemm"] > 0 and table["ms"]["attention"] > 0 and table["ms"]["loss"] > 0
    assert sum(v for c, v in table["ms"].items() if c != "idle") == pytest.approx(table["kernel_ms"])
    assert table["busy_ms"] <= table["wall_ms"] * 1.001
