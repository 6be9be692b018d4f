"""Draws the JSON printed by bench/shared_state.py as a PNG.

    python bench/plot_shared_state.py bench/results/shared_state.json -o docs/shared_state.png

Left: joiner GB/s per kind of joiner and number of holders, each next to the same steps
done by plain threads, and the loopback TCP references of the same run. Right: one
tensor over slow emulated links from 1 and from 3 holders. Needs matplotlib (a
bench-only dependency).
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("json", nargs="?", default="bench/results/shared_state.json")
    ap.add_argument("-o", "--out", default="docs/shared_state.png")
    args = ap.parse_args()
    with open(args.json) as f:
        r = json.load(f)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5),
                                      gridspec_kw={"width_ratios": [3, 1]})
    rows = r["joiner"]
    labels = [f"{j['joiner_tensors']}\n{'in place' if j['in_place'] else 'staged'}\n"
              f"{j['sources']} holder{'s' if j['sources'] > 1 else ''}" for j in rows]
    at = list(range(len(rows)))
    left.bar([x - 0.2 for x in at], [j["GBps"] for j in rows], width=0.4, color="tab:blue",
             label="pccl joiner")
    if all("plain_same_work_GBps" in j for j in rows):
        left.bar([x + 0.2 for x in at], [j["plain_same_work_GBps"] for j in rows], width=0.4,
                 color="tab:gray", label="same steps in plain threads and sockets")
    for value, name, style in [
            (r["loopback_1_stream_GBps"], "TCP 1 stream, hot 4 MiB buffers", "--"),
            (r["loopback_4_streams_whole_buffers_GBps"], "TCP 4 streams, 1 GiB buffers", ":"),
            (r["loopback_4_streams_whole_buffers_hashed_GBps"],
             "TCP 4 streams, 1 GiB buffers, hashed", "-."),
            (r["loopback_1_stream_fresh_memory_GBps"], "TCP 1 stream into fresh memory",
             (0, (1, 4)))]:
        left.axhline(value, color="gray", linestyle=style, label=f"{name} ({value:.2f})")
    left.set_xticks(range(len(rows)), labels, fontsize=7)
    left.set_ylabel("GB/s (1 GiB joiner sync)")
    left.set_title("RECEIVE_ONLY joiner, all peers on one 2-core host")
    left.legend(fontsize=8)
    slow = r["slow_links"]
    right.bar([f"{s['sources']}, {s.get('pool_size', 1)}" for s in slow],
              [s["MBps"] for s in slow], color="tab:green")
    right.set_xlabel("holders, pool size", fontsize=9)
    right.set_ylabel("MB/s")
    right.set_title(f"{slow[0]['bytes'] >> 20} MiB tensor, {slow[0]['link_MBps']:.0f} MB/s "
                    "per connection", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
