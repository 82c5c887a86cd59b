"""Per-prompt median and ratio of total tokens/s of each method against hf_assisted, per bench JSON:
    python bench/studies/runner_up/totals.py FILE.json ..."""
import json
import statistics as st
import sys

ref = "hf_assisted"
for f in sys.argv[1:]:
    d = json.load(open(f)); o = d["outputs"]
    print(f.split("/")[-1])
    for m in o:
        if m == ref: continue
        r = [ (a["tokens"]/st.median(a["seconds"])) / (b["tokens"]/st.median(b["seconds"])) for a, b in zip(o[m], o[ref])]
        tot = (sum(a["tokens"] for a in o[m]) / sum(st.median(a["seconds"]) for a in o[m])) / (sum(b["tokens"] for b in o[ref]) / sum(st.median(b["seconds"]) for b in o[ref]))
        tasks = {}
        for x, a in zip(r, o[m]): tasks.setdefault(a["task"], []).append(x)
        worst = min((st.median(v), k) for k, v in tasks.items())
        ts = d["methods"][m].get("time_shares", {}).get("drafter")
        print(f"  {m:28s} x{ref}: median {st.median(r):.2f} totals {tot:.2f} worst {worst[1]} {worst[0]:.2f}" + (f" drafting {ts:.0%}" if ts else "") + "  " + " ".join(f"{k[:5]} {st.median(v):.2f}" for k, v in tasks.items()))
