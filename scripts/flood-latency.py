#!/usr/bin/env python3
"""Latency of a normal completion alone and while clients flood the server with over-long
prompts (issue 39: two clients looping on 2 MB prompts took a 4-token completion from 3 ms to
5 s, six to 22 s). A measurement, not a test: it prints the figures and asserts nothing.

    scripts/flood-latency.py --bin target/release/gpu-offload --model stories260K-f32.gguf
    scripts/flood-latency.py --url http://127.0.0.1:8080      # a server already running

Each flooder loops on POST /v1/completions with a prompt of --flood-bytes (default 2,000,000,
just under the body limit) on a kept-alive connection; the normal client sends a 4-token greedy
completion --samples times and the median and 90th percentile are printed, alone and flooded.

Each flooder is its own process (threads of one Python process would make the measuring client
wait for the interpreter's lock, up to 5 ms a switch, and count that as the server's latency).
`--pin` runs the server on CPU 0 and every client on the others (`taskset`), standing in for
flooders on other machines: on a 2-core machine, unpinned flooders take the server's CPU time
whatever the server does.
"""

import argparse
import http.client
import json
import multiprocessing
import os
import statistics
import subprocess
import time
import urllib.parse


def post(conn, path, body):
    conn.request("POST", path, body=body, headers={"content-type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    return r.status, data


def normal_latencies(host, port, samples, prompt):
    body = json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0})
    out = []
    for _ in range(samples):
        conn = http.client.HTTPConnection(host, port, timeout=120)
        t = time.perf_counter()
        status, data = post(conn, "/v1/completions", body)
        out.append(time.perf_counter() - t)
        conn.close()
        if status != 200:
            raise SystemExit(f"normal completion failed: {status} {data[:200]!r}")
        time.sleep(0.02)
    return out


def flooder(host, port, body, stop, results, cpus):
    if cpus:
        os.sched_setaffinity(0, cpus)
    counts = {}
    while not stop.is_set():
        try:
            conn = http.client.HTTPConnection(host, port, timeout=120)
            while not stop.is_set():
                status, _ = post(conn, "/v1/completions", body)
                counts[status] = counts.get(status, 0) + 1
        except (OSError, http.client.HTTPException):
            counts["conn_error"] = counts.get("conn_error", 0) + 1
            time.sleep(0.01)
    results.put(counts)


def summary(xs):
    xs = sorted(xs)
    p90 = xs[min(len(xs) - 1, int(len(xs) * 0.9))]
    return f"median {statistics.median(xs) * 1e3:.1f} ms, p90 {p90 * 1e3:.1f} ms, max {xs[-1] * 1e3:.1f} ms"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--bin")
    ap.add_argument("--model")
    ap.add_argument("--server-args", default="--device cpu --threads 1")
    ap.add_argument("--flooders", type=int, default=6)
    ap.add_argument("--flood-bytes", type=int, default=2_000_000)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--pin", action="store_true", help="server on CPU 0, clients on the rest")
    a = ap.parse_args()
    client_cpus = None
    if a.pin:
        all_cpus = sorted(os.sched_getaffinity(0))
        if len(all_cpus) < 2:
            raise SystemExit("--pin needs at least 2 CPUs")
        client_cpus = set(all_cpus[1:])
        os.sched_setaffinity(0, client_cpus)

    server = None
    if a.url:
        u = urllib.parse.urlparse(a.url)
        host, port = u.hostname, u.port
    else:
        if not (a.bin and a.model):
            raise SystemExit("give --url, or --bin and --model")
        cmd = [a.bin, "serve", "--model", a.model, "--port", "0"] + a.server_args.split()
        if a.pin:
            cmd = ["taskset", "-c", "0"] + cmd
        server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = server.stdout.readline()
        if not line.startswith("listening on "):
            raise SystemExit(f"server did not start: {line!r}")
        u = urllib.parse.urlparse(line.split()[-1])
        host, port = u.hostname, u.port
    try:
        normal_latencies(host, port, 5, a.prompt)  # warm up
        alone = normal_latencies(host, port, a.samples, a.prompt)
        body = json.dumps({"prompt": "abcdefgh" * (a.flood_bytes // 8), "max_tokens": 4})
        stop = multiprocessing.Event()
        results = multiprocessing.Queue()
        procs = [
            multiprocessing.Process(
                target=flooder, args=(host, port, body, stop, results, client_cpus), daemon=True
            )
            for _ in range(a.flooders)
        ]
        for p in procs:
            p.start()
        time.sleep(1.0)
        t0 = time.perf_counter()
        flooded = normal_latencies(host, port, a.samples, a.prompt)
        dt = time.perf_counter() - t0
        stop.set()
        total = {}
        for _ in procs:
            for k, v in results.get(timeout=150).items():
                total[k] = total.get(k, 0) + v
        for p in procs:
            p.join(timeout=10)
        print(f"alone:                       {summary(alone)}")
        print(f"with {a.flooders} flooders of {a.flood_bytes} B: {summary(flooded)}")
        print(f"ratio of medians: {statistics.median(flooded) / statistics.median(alone):.2f}")
        print(f"flood answers ({dt:.1f} s of measuring, and until the flooders stopped): {total}")
        print("pinned: server on CPU 0, clients on " + str(sorted(client_cpus)) if a.pin else "not pinned: server and clients share every CPU")
    finally:
        if server:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
