"""Part of bench/trainer/bench_trainer.py: the printed report of a run's results (every path beside the device it ran
on, the ratios, the targets, the sp=1 check and the pack search)."""

from __future__ import annotations

from bench.trainer.search import TARGET_PACK

TARGET_RATIO = 1.2  # issue #5: ours over the best HF path's tokens/s
TARGET_MFU = 0.45


def fmt(value, spec, missing="n/a") -> str:
    return missing if value is None else format(value, spec)


def print_report(results: dict) -> None:
    dev = results["device"]
    model, data, settings = results["model"], results["data"], results["settings"]
    print(f"\nTrainer benchmark on {dev['name']} ({dev['type']}, {settings['dtype']}), torch {dev['torch']}, "
          f"transformers {dev['transformers']}, deepspeed {dev['deepspeed']}")
    print(f"model {model['shape']} ({model['num_params'] / 1e9:.3f}B params, {model['architecture']}); packs of "
          f"{settings['pack_len']} tokens, {data['docs_per_pack_mean']:.1f} docs/pack (p50 {data['doc_len_p50']}, "
          f"max {data['doc_len_max']}); {settings['steps']} timed steps after {settings['warmup']} warm-up; "
          f"MFU peak {fmt(dev['peak_flops'] and dev['peak_flops'] / 1e12, '.0f')} TFLOP/s")
    head = (f"{'path':<24}{'attention':<28}{'tokens/s':>11}{'TFLOP/s':>9}{'MFU %':>8}{'step s':>9}{'peak GiB':>10}"
            f"{'1st loss':>10}")
    print(f"[measured on {dev['name']}]\n{head}\n{'-' * len(head)}")
    for name, r in results["paths"].items():
        if not r.get("ran"):
            print(f"{name:<24}{r.get('attention', ''):<28}  did not run: {r.get('error')}")
            continue
        print(f"{name:<24}{r['attention']:<28}{r['tokens_per_s']:>11,.0f}{r['tflops']:>9.1f}"
              f"{fmt(r['mfu'] and 100 * r['mfu'], '.1f'):>8}{r['step_time_s_mean']:>9.3f}{r['peak_mem_gib']:>10.2f}"
              f"{fmt(r['first_loss'], '.4f'):>10}")
    for name, r in results["paths"].items():
        if name != "ours":
            print(f"{name}: {r['label']}")
    ours = results["paths"].get("ours", {})
    if ours.get("attention_kernel"):
        print(f"ours: attention {ours['attention_kernel']}; decoder kernels {ours['decoder_kernels']}")
    if ours.get("optimizer_step_s_mean"):
        print(f"ours: engine.step (optimizer) {ours['optimizer_step_s_mean']:.3f} s of {ours['step_time_s_mean']:.3f} s "
              "per step; the rest is forward, backward, gradient reduction and step statistics")
    for note in results["notes"]:
        print(f"note: {note}")
    for name, r in results["paths"].items():
        for failed in r.get("tried") or []:
            print(f"note: {name} ran after {failed}")
    for skipped in results.get("skipped") or []:
        print(f"skipped: {skipped}")
    if results.get("no_ratio"):
        print(f"no ratio: {results['no_ratio']}")
    for name, ratio in results["ratios"].items():
        print(f"ratio {name}: {ratio['tokens_per_s']:.2f}x tokens/s, "
              f"peak memory {fmt(ratio['peak_mem'], '.2f')}x  [{dev['name']}]")
    t = results["targets"]
    print(f"targets: ours/best HF >= {TARGET_RATIO}x tokens/s: {fmt(t['ratio_met'], '')} | ours MFU >= "
          f"{100 * TARGET_MFU:.0f}%: {fmt(t['mfu_met'], '')} | pack >= {TARGET_PACK}: {fmt(t['pack_met'], '')}")
    if results.get("sp1_check"):
        c = results["sp1_check"]
        if "error" in c:
            print(f"sp=1 check: {c['error']}")
        else:
            print(f"sp=1 check [{dev['name']}]: Ulysses dispatcher {c['dispatcher_step_s_mean']:.3f} s/step vs direct "
                  f"{c['direct_step_s_mean']:.3f} s/step -> {c['speed_ratio_dispatcher_over_direct']:.3f}x")
    search = results.get("pack_search")
    if search:
        print(f"pack search (ours, {search['docs']} docs, ckpt levels {search['ckpt_levels']}) [{dev['name']}]:")
        for a in search["attempts"]:
            status = "ok" if a["ok"] else ("OOM" if a["oom"] else f"error {a.get('error')}")
            extra = (f" {a['step_time_s']:.2f} s/step, {a['tokens_per_s']:,.0f} tok/s, MFU "
                     f"{fmt(a['mfu'] and 100 * a['mfu'], '.1f')}{'%' if a['mfu'] else ''}" if a["ok"] else "")
            print(f"  {a['pack_len']:>8} tokens, {a['ckpt_layers']:>3} ckpt layers: {status:<4} peak "
                  f"{fmt(a.get('peak_mem_gib'), '.2f')} GiB{extra}")
        for s in search["skipped"]:
            print(f"  {s['pack_len']:>8} tokens, {s['ckpt_layers']:>3} ckpt layers: skipped ({s['why']})")
        print(f"  longest pack that trained: {search['longest_ok']} tokens with {search['ckpt_layers_needed']} "
              f"checkpointed layers (goal {TARGET_PACK}: {'met' if search['goal_met'] else 'not met'})")
