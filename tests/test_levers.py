"""hbp_train/model/levers.py: the memory levers (tiled MLP, activation-checkpoint offload) are exact, per group.

Default tier: at SP 1 in one process, a dense and an MoE model (router loss made to matter) give the same token
losses, router loss and gradients with each lever on as with none, the levers shown to run (MLP calls counted per
tile, router records joined per layer, DeepSpeed's offload hooks counting the marked inputs, and with the copy
forced on the CPU, the inputs round-tripping through host buffers); DeepSpeed's own TiledMLP shown to lose the
router loss's gradient (why it is not used); the plan fields, the --groups syntax and the one-line refusals.
Full tier (slow, spawns gloo processes): SP 2 against the single-process reference, and the trainer over a plan
switching between a group with levers and one without, under ZeRO-2 and ZeRO-3, equal to the same plan without
levers.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from hbp_train.common.errors import UserError
from hbp_train.common.labels import IGNORE_INDEX
from hbp_train.model.hf_model import set_checkpointed_layers
from hbp_train.model.levers import Levers, install_levers, mlp_of, step_levers
from hbp_train.model.moe import router_aux_of
from tests.test_families import _pack_batch, _wrapper, losses_and_grads, router_loss_keys, tiny_model

FAMILIES = ("llama", "mixtral")  # dense; MoE with HF's router loss (router_loss_keys: coefficient 0.5)


def forced_offload(base=None):
    """DeepSpeed's offload context (ours, or ``base``) with its copies made on the CPU too (there it skips every
    tensor: no device to free), so that the inputs really go to a host buffer and come back."""
    from hbp_train.model.levers import hidden_states_offload

    class Forced(base or hidden_states_offload()):
        def _should_skip(self, tensor):
            return isinstance(tensor, torch.nn.Parameter) or self._num_bytes(tensor) < self.min_offload_bytes

    return Forced()


def _count_calls(model) -> list:
    """Per decoder layer, how often its MLP's first linear weight-holding module runs (forward + recompute)."""
    counts = []
    for layer in model.base_model.layers:
        first = next(m for m in mlp_of(layer).modules() if any(p.dim() >= 2 for p in m.parameters(recurse=False)))
        counts.append(0)
        index = len(counts) - 1
        first.register_forward_hook(lambda *_, i=index: counts.__setitem__(i, counts[i] + 1))
    return counts


def _assert_same(got, ref, what):
    loss, grads = got
    ref_loss, ref_grads = ref
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=what)
    assert grads.keys() == ref_grads.keys() and grads, what
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-5, msg=f"{what}: {name}")


def _count_restored_alive(ctx) -> list:
    """Make ``ctx`` (an offload context) record, at each restore of an offloaded input, how many of the inputs it
    restored so far are still alive, this one included (by their storage: a recompute keeps a restored input
    through views of it, not the tensor object handed back); returns the list it fills."""
    from torch.multiprocessing.reductions import StorageWeakRef

    restore, restored, alive = ctx._restore_tensor, [], []

    def counted(tensor_id, cache=True):
        tensor = restore(tensor_id, cache)
        restored.append(StorageWeakRef(tensor.untyped_storage()))
        alive.append(sum(not ref.expired() for ref in restored))
        return tensor

    ctx._restore_tensor = counted  # both DeepSpeed's cached unpack and restore_input go through it
    return alive


def test_offload_frees_each_restored_input_before_the_next_layer_restores_its_own():
    """Every layer of a 4-layer Llama checkpointed and offloaded, the copies forced through host buffers: during the
    backward one restored input is alive at a time (each layer's, freed after its recompute and backward; nested in
    tiled-MLP checkpoints too), where DeepSpeed's own class, which caches what it restores, holds all 4 at the last
    restore; the loss and gradients stay the reference's. A second backward over the retained graph stops in one
    line."""
    from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload

    model = tiny_model("llama", num_hidden_layers=4)
    batch = [tuple(_pack_batch(seed=1).values())]
    ref = losses_and_grads(model, batch)
    levers = install_levers(model)
    set_checkpointed_layers(model, 4)
    for what, base, tiles, expected in (("DeepSpeed's cache", CheckpointHiddenStatesOffload, 1, [1, 2, 3, 4]),
                                        ("one use", None, 1, [1, 1, 1, 1]), ("one use, tiled", None, 4, [1, 1, 1, 1])):
        levers.set(Levers(mlp_tiles=tiles, offload=True))
        levers._offload = forced_offload(base)
        alive = _count_restored_alive(levers._offload)
        with levers.micro_batch():
            got = losses_and_grads(model, batch)
        _assert_same(got, ref, what)
        stats = levers.offload_stats
        assert stats.offloaded_tensors == 3 and stats.kept_last_tensors == 1, (what, stats)  # the newest stays
        assert alive == expected, (what, alive)

    ids, positions, labels, cu, max_len, _ = batch[0]
    with levers.micro_batch():
        loss = _wrapper(model, None)(ids, positions, labels, cu, max_len).sum()
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match=r"no longer held: .*retain_graph=True") as info:
            loss.backward()
    assert "\n" not in str(info.value)
    levers.set(Levers())
    set_checkpointed_layers(model, 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_lever_gives_the_same_loss_and_gradients_at_sp1(family):
    model = tiny_model(family, num_hidden_layers=3, **router_loss_keys(family))
    batch = [tuple(_pack_batch(seed=1).values())]  # one pack of 3 samples, 24 tokens
    num_tokens = batch[0][0].shape[1]
    ref = losses_and_grads(model, batch, with_aux=True)  # the token losses (and router loss) and gradients
    levers = install_levers(model)
    calls = _count_calls(model)

    # tiled MLP: 5 tiles (the last one short), then 26 (more tiles than tokens: the 2 empty tiles run too)
    for tiles in (5, 26):
        levers.set(Levers(mlp_tiles=tiles))
        calls[:] = [0] * len(calls)
        _assert_same(losses_and_grads(model, batch, with_aux=True), ref, f"{family} {tiles} tiles")
        assert calls == [2 * tiles] * len(calls), calls  # each tile in forward, and again in backward
    if router_aux_of(model.config) is not None:
        # the routers ran once per tile; forward_hidden joins their records back into one [T, E] per MoE layer,
        # which the router loss needs (a tile's records alone would give another aux)
        wrapper = _wrapper(model, router_aux_of(model.config))
        wrapper(*batch[0][:5])
        assert [t.shape[0] for t in wrapper.router_logits] == [num_tokens] * 3

    # offload of the checkpointed layers' inputs, with and without the tiled MLP; DeepSpeed's context runs on the
    # CPU (its hooks see every marked input and leave it in place), and with its copies forced they round-trip
    set_checkpointed_layers(model, 2)
    for tiles, forced in ((1, False), (1, True), (4, True)):
        levers.set(Levers(mlp_tiles=tiles, offload=True))
        levers._offload = forced_offload() if forced else None
        with levers.micro_batch():
            got = losses_and_grads(model, batch, with_aux=True)
        _assert_same(got, ref, f"{family} offload tiles={tiles} forced={forced}")
        stats = levers.offload_stats
        assert stats.marked_tensors == 2, stats  # the inputs of the 2 checkpointed layers
        if forced:  # the older one left for a host buffer and came back; the newest stays (keep_last_count=1)
            assert stats.offloaded_tensors == stats.restored_tensors == 1 and stats.offloaded_bytes > 0, stats
        else:
            assert stats.skipped_marked_tensors == 2 and stats.offloaded_tensors == 0, stats
    # off again: the plain model, no offload context
    levers.set(Levers())
    set_checkpointed_layers(model, 0)
    assert isinstance(levers.micro_batch(), nullcontext)
    _assert_same(losses_and_grads(model, batch, with_aux=True), ref, f"{family} levers off")


def test_deepspeeds_tiled_mlp_loses_the_router_loss_gradient():
    """Why the tiled MLP is ours and not DeepSpeed's TiledMLP: TiledMLP runs the shards' forward under no_grad,
    so the router logits an MoE block records carry no gradient and the router loss does not reach the router;
    ours gives the untiled gradient."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    model = tiny_model("mixtral", **router_loss_keys("mixtral"))
    batch = [tuple(_pack_batch(seed=1).values())]
    _, ref = losses_and_grads(model, batch, with_aux=True)
    router = "model.layers.0.mlp.gate.weight"
    originals = {}
    for layer in model.base_model.layers:
        block = mlp_of(layer)
        originals[block] = block.forward
        # TiledMLP hands its function [tokens, hidden] shards in backward: the block reads [batch, tokens, hidden]
        block.forward = (lambda x, b=block, f=block.forward: TiledMLP.apply(
            lambda _, shard: f(shard.reshape(1, -1, shard.shape[-1])).reshape(shard.shape), b, x, 3,
            list(b.parameters())))
    try:
        _, theirs = losses_and_grads(model, batch, with_aux=True)
    finally:
        for block, forward in originals.items():
            block.forward = forward
    assert not torch.allclose(theirs[router], ref[router], rtol=1e-4, atol=1e-5)
    levers = install_levers(model)
    levers.set(Levers(mlp_tiles=3))
    _, ours = losses_and_grads(model, batch, with_aux=True)
    torch.testing.assert_close(ours[router], ref[router], rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- the group fields and their rules
def test_plan_groups_carry_the_levers_and_plans_without_them_keep_their_bytes():
    from hbp_train.planning.plan import GroupSpec, PlanConfig

    plain = GroupSpec(1024, 1, 2)
    assert plain.to_dict() == {"pack_len": 1024, "sp": 1, "ckpt_layers": 2}  # no lever keys written
    both = GroupSpec(4096, 2, 2, tiled_mlp=True, offload_activations=True)
    assert both.to_dict() == {"pack_len": 4096, "sp": 2, "ckpt_layers": 2, "tiled_mlp": True,
                              "offload_activations": True}
    record = PlanConfig(world_size=2, groups=[plain, both]).to_dict()
    assert PlanConfig.from_record(record).groups == (plain, both)
    assert GroupSpec.from_dict({"pack_len": 8, "sp": 1}) == GroupSpec(8, 1)  # a plan from before the levers
    with pytest.raises(UserError, match="offload_activations with ckpt_layers 0"):
        GroupSpec(4096, 2, 0, offload_activations=True)
    with pytest.raises(UserError, match="tiled_mlp must be true or false"):
        GroupSpec(4096, 2, tiled_mlp="yes")


def test_the_groups_flag_takes_levers_as_a_fourth_field():
    from data_tools.packing.groups import CliError, parse_groups

    groups = parse_groups("1024:1,4096:2:3:-,16384:2:4:tiled_mlp+offload,32768:2:4:offload", None, 2)
    assert [(g.tiled_mlp, g.offload_activations) for g in groups] == [(False, False), (False, False), (True, True),
                                                                        (False, True)]
    for bad, words in (("4096:2:3:tiled", "unknown memory lever 'tiled'"), ("4096:2:0:offload", "offload needs"),
                       ("4096:2:3:offload:x", "pack_len:sp:ckpt_layers:levers")):
        with pytest.raises(CliError, match=words) as info:
            parse_groups(bad, None, 2)
        assert "--groups" in str(info.value) and "\n" not in str(info.value)


def test_the_step_levers_follow_the_group_and_zero3_keeps_one_tiling():
    groups = [{"pack_len": 1024, "sp": 1}, {"pack_len": 4096, "sp": 2, "tiled_mlp": True},
              {"pack_len": 16384, "sp": 2, "tiled_mlp": True, "offload_activations": True, "ckpt_layers": 2}]
    hidden = 512  # tiles of 512 tokens of a rank's slice
    assert [step_levers(g, groups, hidden, 2) for g in groups] == [Levers(), Levers(4), Levers(16, True)]
    # ZeRO-3: the most tiles of any group, in every step (one module order for its prefetch trace); offload per group
    assert [step_levers(g, groups, hidden, 3) for g in groups] == [Levers(16), Levers(16), Levers(16, True)]


def test_the_refusals_are_one_line_before_the_model_is_trained():
    from hbp_train.model.levers import check_group_levers, check_plan_levers
    from hbp_train.model.hf_model import ModelConfig, hf_config_for
    from hbp_train.model.families import tiny_config

    groups = [{"pack_len": 64, "sp": 1, "offload_activations": True}]
    with pytest.raises(UserError, match="group 0 .* 0 checkpointed layers") as info:
        check_group_levers(groups, [0], "packed/plan.json")
    assert str(info.value).startswith("packed/plan.json") and "\n" not in str(info.value)
    tiled = [{"pack_len": 64, "sp": 1, "tiled_mlp": True}]
    config = hf_config_for(ModelConfig(config=tiny_config("mixtral", router_jitter_noise=0.1), architecture="mixtral"))
    with pytest.raises(UserError, match="router_jitter_noise=0.1"):
        check_plan_levers(config, tiled, [0], "none", "data.shards=x")
    with pytest.raises(UserError, match="model.kernels=compile"):
        check_plan_levers(config, tiled, [0], "compile", "data.shards=x")
    config.router_jitter_noise = 0.0
    check_plan_levers(config, tiled, [0], "none", "data.shards=x")  # mixtral's MoE block tiles


def test_the_run_config_check_refuses_offload_without_checkpointed_layers_before_any_worker(tmp_path):
    """config.check_paths (run by ./launch.sh train before the workers): the shards' group asks for offload and the
    run checkpoints no layer of it (the plan's null, train.ckpt_layers' 0): one line naming data.shards."""
    from hbp_train import config
    from tests.assets.packed_fixture import ONE_RANK_STEPS, TINY_LLAMA, synthetic_samples, write_packed

    shards = write_packed(str(tmp_path / "packed"), synthetic_samples(12, 512, seed=1), ONE_RANK_STEPS, world_size=1,
                          groups={1: {"offload_activations": True, "tiled_mlp": True}})
    model = "model.config={" + ",".join(f"{k}:{v}" for k, v in TINY_LLAMA.items()) + "}"
    base = ["experiment=cpu_demo", f"data.shards={shards}", model]
    with pytest.raises(config.ConfigError, match="data.shards=.* group 1 .* 0 checkpointed layers") as info:
        config.check_levers(config.load([*base, "train.ckpt_layers=[2,0]"]))
    assert "\n" not in str(info.value)
    config.check_levers(config.load([*base, "train.ckpt_layers=[0,1]"]))  # group 1 checkpoints a layer: fine


# ------------------------------------------------------------------------------------------- full tier: SP 2
def _sp2_worker(rank, world_size, families):
    """Each family at sp=2 with each lever (none, tiled MLP, offload forced through host buffers, both) on the same
    weights, as the trainer runs a micro-batch; returns the gathered token losses (router loss first) and the
    rank-averaged gradients."""
    import torch.distributed as dist

    from hbp_train.distributed.groups import build_parallel_state, init_distributed
    from hbp_train.model.ulysses import setup_sequence_parallel
    from tests.test_families import aux_per_token

    init_distributed()
    pstate = build_parallel_state([1, 2])
    out = {}
    for family in families:
        model = tiny_model(family, num_hidden_layers=3, **router_loss_keys(family))
        aux_cfg = router_aux_of(model.config)
        sp = setup_sequence_parallel(model, pstate)
        wrapper = _wrapper(model, aux_cfg)
        levers = install_levers(model)
        batch = _pack_batch(seed=1)
        sp.set_active(2)
        for name, setting in (("tiled", Levers(mlp_tiles=3)), ("offload", Levers(offload=True)),
                              ("both", Levers(mlp_tiles=5, offload=True))):
            levers.set(setting)
            levers._offload = forced_offload()
            set_checkpointed_layers(model, 2 if setting.offload else 0)
            model.zero_grad(set_to_none=True)
            local = sp.split(batch)
            with levers.micro_batch():
                loss_T = wrapper(local["input_ids"], local["position_ids"], local["shift_labels"])
                objective = loss_T.sum()
                aux_T = None
                if aux_cfg is not None:
                    aux_T = aux_per_token(wrapper, aux_cfg, local["num_local_tokens"], local["sample_ids"],
                                          len(batch["cu_seqlens"]) - 1, sp.reduce_loss)
                    objective = objective + aux_cfg.coef * (aux_T * (local["shift_labels"][0] != IGNORE_INDEX)).sum()
                sp.reduce_loss(objective).backward()
            if setting.offload:
                assert levers.offload_stats.restored_tensors == 1, levers.offload_stats

            def gathered(values):
                pieces = [torch.empty_like(values) for _ in range(world_size)]
                dist.all_gather(pieces, values.detach())
                return torch.cat(pieces)[: batch["input_ids"].shape[1]]

            grads = {}
            for pname, param in model.named_parameters():
                grad = param.grad.clone() if param.grad is not None else torch.zeros_like(param)
                dist.all_reduce(grad)
                grads[pname] = grad / world_size
            losses = gathered(loss_T)
            if aux_T is not None:
                losses = torch.cat([gathered(aux_T), losses])
            out[family, name] = (losses, grads)
        sp.uninstall(model)
    return out if rank == 0 else None


SP2_FAMILIES = (*FAMILIES, "deepseek_v3")  # + MLA with DeepSeek's per-sample router loss (the chosen experts joined)


@pytest.mark.slow
@pytest.mark.full
def test_levers_at_sp2_equal_the_single_process_reference():
    """2 gloo processes, a dense and two MoE families at SP 2 with each lever: the untiled single-process losses,
    router loss and gradients."""
    from tests.distributed import run_distributed

    result = run_distributed(_sp2_worker, 2, SP2_FAMILIES, timeout=900)[0]
    for family in SP2_FAMILIES:
        model = tiny_model(family, num_hidden_layers=3, **router_loss_keys(family))
        ref_loss, ref_grads = losses_and_grads(model, [tuple(_pack_batch(seed=1).values())], with_aux=True)
        for name in ("tiled", "offload", "both"):
            _assert_same(result[family, name], (ref_loss, ref_grads), f"{family} sp=2 {name}")


# ------------------------------------------------------------------ full tier: the trainer, ZeRO-2 and ZeRO-3
# Two ranks; group 0 at sp=1 without levers, group 1 at sp=2 with both (its pack_len set so that a rank's slice
# makes 8 tiles of hidden_size=64 tokens: more than some short packs have tokens, so empty tiles run too).
LEVER_STEPS = [
    {"group": 0, "replicas": [[[0, 1], [2]], [[3], [4, 5]]]},
    {"group": 1, "replicas": [[[6, 7], [8]]]},
    {"group": 0, "replicas": [[[9]], [[10, 11]]]},
    {"group": 1, "replicas": [[[12, 13]]]},
]
LEVER_GROUPS = {1: {"sp": 2, "pack_len": 1024, "ckpt_layers": 2, "tiled_mlp": True, "offload_activations": True}}
TRAIN_FAMILIES = ("mistral", "mixtral")  # dense (1 kv head, replicated at sp=2); MoE with HF's router loss


def _trainer_worker(rank, world_size, shards, out):
    """The trainer over the plan with levers and over the same plan without, per family and ZeRO stage (ZeRO-3
    gathering every weight for each use: no parameter kept whole, so the ranks' tiles must pair up); returns the
    per-step losses, the final weights, the levers each micro-batch ran with and the offload counters."""
    import deepspeed
    from deepspeed.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload

    from hbp_train import config, trainer
    from hbp_train.distributed.groups import init_distributed
    from hbp_train.model import levers as levers_module
    from tests.test_families import TRAIN_ROUTER_LOSS, model_overrides

    # the copies made on the CPU too (DeepSpeed skips them there): the inputs go through host buffers and back
    CheckpointHiddenStatesOffload._should_skip = forced_offload()._should_skip.__func__
    applied, offloaded = [], []
    plain_set = levers_module.MemoryLevers.set

    def recording_set(self, levers):
        applied.append(levers)
        return plain_set(self, levers)

    levers_module.MemoryLevers.set = recording_set
    plain_exit = levers_module._Counted.__exit__

    def counted_exit(self, *exc):  # each offloading micro-batch's counters
        done = plain_exit(self, *exc)
        offloaded.append(self.levers.offload_stats)
        return done

    levers_module._Counted.__exit__ = counted_exit
    init_distributed()
    result = {}
    for family in TRAIN_FAMILIES:
        for stage in (2, 3):
            for name, folder in shards.items():
                applied.clear()
                offloaded.clear()
                zero = ["deepspeed.zero_stage=3", "++deepspeed.extra={zero_optimization:"
                        "{stage3_param_persistence_threshold:0}}"] if stage == 3 else []
                cfg = config.load(["experiment=cpu_demo", f"data.shards={folder}", "logging=quiet",
                                   f"train.out_dir={out}/{family}_{stage}_{name}", "train.lr=1e-2",
                                   "train.warmup_steps=0", "train.eps=0.01", "train.save_final=false", "data.epochs=1",
                                   *zero,
                                   *model_overrides(family, **TRAIN_ROUTER_LOSS.get(family, {}))])
                summary = trainer.train(cfg)
                model = summary["run"].model
                with deepspeed.zero.GatheredParameters(list(model.parameters())):
                    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
                result[family, stage, name] = (summary["losses"], weights, list(applied), list(offloaded))
    return result


@pytest.mark.slow
@pytest.mark.full
def test_the_trainer_switches_levers_per_group_and_trains_the_same_under_zero2_and_zero3(tmp_path):
    """2 gloo ranks, a dense and an MoE family, ZeRO-2 and ZeRO-3: the trainer over a plan whose sp=2 group runs the
    tiled MLP and offload and whose sp=1 group runs neither gives the per-step losses and final weights of the same
    plan without levers; the levers follow the group (ZeRO-3: one tiling in every step) and the offloaded inputs
    went through host buffers."""
    from tests.assets.packed_fixture import synthetic_samples, write_packed
    from tests.distributed import run_distributed

    samples = synthetic_samples(14, 4096, seed=7)
    plain = {1: {k: v for k, v in LEVER_GROUPS[1].items() if k not in ("tiled_mlp", "offload_activations")}}
    shards = {"levers": write_packed(str(tmp_path / "levers"), samples, LEVER_STEPS, world_size=2, groups=LEVER_GROUPS),
              "plain": write_packed(str(tmp_path / "plain"), samples, LEVER_STEPS, world_size=2, groups=plain)}
    result = run_distributed(_trainer_worker, 2, shards, str(tmp_path / "runs"), timeout=1200)[0]
    tiled = Levers(mlp_tiles=8, offload=True)  # 1024 tokens at sp=2: 512 per rank, tiles of 64
    for family in TRAIN_FAMILIES:
        for stage in (2, 3):
            losses, weights, applied, stats = result[family, stage, "levers"]
            ref_losses, ref_weights, ref_applied, _ = result[family, stage, "plain"]
            what = f"{family} ZeRO-{stage}"
            assert len(losses) == len(LEVER_STEPS) and all(0 < x < 20 for x in losses), what
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6,
                                       msg=what)
            # AdamW with eps 0.01: its update grows with a small gradient instead of jumping to +-lr, which would turn
            # the tiles' rounding of a near-0 gradient (an embedding row, an expert seen once) into a 1e-4 change
            for name, ref in ref_weights.items():
                torch.testing.assert_close(weights[name], ref, rtol=1e-5, atol=1e-6, msg=f"{what}: {name}")
            untiled = Levers(mlp_tiles=8) if stage == 3 else Levers()  # ZeRO-3: the most tiles, every step
            assert applied == [untiled, tiled, untiled, tiled], (what, applied)
            assert set(ref_applied) == {Levers()}, (what, ref_applied)
            assert len(stats) == 3 and all(s.offloaded_tensors == s.restored_tensors == 1 for s in stats), (what,
                                                                                                           stats)
