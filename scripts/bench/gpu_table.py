"""One table of every figure scripts/gpu_check.sh measured, each beside the GPU engine's target.

    python scripts/bench/gpu_table.py gpu_check_results      # the folder gpu_check.sh wrote ($OUT)

Reads the folder's JSON files (bench_moe.py --json layer.json, bench_train.py --json step_*.json,
bench_quality.py's quality/results.json) and tests.txt (one "rc name" line per test script run); a figure
whose file is missing (a step that failed or was skipped) shows as "-". Prints markdown; exit code 0.
"""
import json
import os
import sys

LAYER = "layer.json"
STEPS = {"E=8": "step_d1024_e8.json", "E=64": "step_d1024_e64.json", "main": "step_main.json",
         "main compiled": "step_main_compiled.json"}


def load(folder, name):
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def figures(folder):
    """[(figure, target, measured text, met: True / False / None)]."""
    out = []

    def add(what, target, value, met, fmt):
        out.append((what, target, "-" if value is None else fmt.format(value), None if value is None else met(value)))

    cells = (load(folder, LAYER) or {}).get("cells", {})
    for shape, cap, label in (("minimind", 1.6, "D=512 E=8 k=2 F=1664"), ("many-experts", 2.0, "D=512 E=64 k=8 F=256")):
        sizes = [int(key.split("N=")[1]) for key in cells if key.startswith(f"{shape} N=")]  # the largest N measured
        cell = cells.get(f"{shape} N={max(sizes)}", {}) if sizes else {}
        value = cell.get("fused", {}).get("fwd_bwd_vs_dense")
        add(f"MoE layer fwd+bwd / dense FFN, N={max(sizes, default=32768):,}, {label}", f"<= {cap}x", value,
            lambda v, c=cap: v <= c, "{:.2f}x")
    runs = {key: load(folder, name) or {} for key, name in STEPS.items()}
    steps = {key: run.get("rows", {}) for key, run in runs.items()}

    def model(key):  # the model a step run measured, from its flags
        a = runs[key].get("args")
        return "-" if not a else (f"D={a['hidden_size']} L={a['num_layers']} E={a['num_experts']} k={a['top_k']} "
                                  f"F={a['moe_intermediate_size']}, {a['batch_size']} x {a['seq_len']}")
    for key, cap in (("E=8", 1.15), ("E=64", 1.30), ("main", 1.25), ("main compiled", None)):
        value = steps[key].get("fused", {}).get("time_vs_dense")
        add(f"training step MoE / dense, {model(key)}" + (", torch.compile" if cap is None else ""),
            "-" if cap is None else f"<= {cap}x", value, lambda v, c=cap: None if c is None else v <= c, "{:.2f}x")
    for row, floor in (("dense", 0.40), ("fused", 0.33)):
        value = steps["E=8"].get(row, {}).get("mfu")
        add(f"MFU, {'dense' if row == 'dense' else 'MoE'}, {model('E=8')}", f">= {floor:.0%}", value,
            lambda v, f=floor: v >= f, "{:.1%}")
    for key, floor in (("E=8", 2.5), ("E=64", 2.5), ("main", 1.5)):
        rows = steps[key]
        value = ((rows["hf"]["time_vs_dense"] / rows["fused"]["time_vs_dense"])
                 if "hf" in rows and "fused" in rows else None)
        add(f"transformers Qwen3-MoE (grouped_mm) step / ours, {model(key)}", f">= {floor}x", value,
            lambda v, f=floor: v >= f, "{:.2f}x")
    quality = {r["row"]: r for r in (load(folder, os.path.join("quality", "results.json")) or {}).get("results", [])
               if "error" not in r}
    moe = [r for name, r in quality.items() if name != "dense" and r.get("val_bpb") is not None]
    value = None
    if moe and quality.get("dense", {}).get("val_bpb") is not None:
        value = min(r["val_bpb"] for r in moe) - quality["dense"]["val_bpb"]
    add("iso-time, best MoE row - dense, val bits/byte", "< 0", value, lambda v: v < 0, "{:+.3f}")
    epochs = [r.get("data_epoch") for r in quality.values()]
    value = max(epochs) if epochs and None not in epochs else None
    add("iso-time, latest data epoch of any row (0: no token trained twice)", "0", value, lambda v: v == 0, "{}")
    tests_path = os.path.join(folder, "tests.txt")
    if os.path.exists(tests_path):
        with open(tests_path, encoding="utf-8") as f:
            runs = [line.split(maxsplit=1) for line in f if line.strip()]
        failed = [name.strip() for rc, name in runs if rc != "0"]
        out.append((f"GPU tests ({len(runs)} scripts)", "all pass", f"{len(runs) - len(failed)} passed" +
                    (f"; failed: {', '.join(failed)}" if failed else ""), not failed))
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    folder = argv[0] if argv else "gpu_check_results"
    rows = figures(folder)
    print("| figure | target | measured | met |\n|---|---|---|---|")
    for what, target, measured, met in rows:
        print(f"| {what} | {target} | {measured} | {'-' if met is None else 'yes' if met else 'NO'} |")


if __name__ == "__main__":
    main()
