#!/usr/bin/env python3
"""Context switch-in latency by tier, and CPU throughput of 2 replicas vs 1, on a Redis context
store. A measurement, not a test: it prints a JSON report and a table, and asserts nothing
(except that it exits non-zero when a configuration could not run at all).

    scripts/bench-context-store.py                       # the full run (a few minutes on 2 cores)
    scripts/bench-context-store.py --quick               # smaller sizes, a smoke run
    scripts/bench-context-store.py --json out.json       # also write the report to a file

It starts its own redis-server (on a free loopback port, no persistence, in a temp dir) and its
own `gpu-offload serve` replicas (--device cpu, --port 0), and kills all of them at the end, on
errors and on SIGINT/SIGTERM too.

Part 1, switch-in latency (per --kv-compression mode, `off` and the default `50%`):
  replica A   --context-store, default --kv-dram-mem (512M), no --kv-dir  -> restores from DRAM
  replica D   --context-store, --kv-dir DIR, --kv-dram-mem 1 (the server refuses 0: "must be a
              positive size"; 1 byte keeps nothing in DRAM)                -> restores from disk
  replica B   --context-store, --kv-dram-mem 1, no --kv-dir; never sees a context before its
              first measured call                                           -> restores from Redis
  All with --parallel 2, --ctx-size 4608 (quick: 1536). A and D each build their own 1k and 4k
  token contexts (one call, a prompt of N seeded random ids in 100..40000, max_tokens 1); B then
  measures the contexts A built and, separately, the ones D built (D keeps chunks exact on its
  --kv-dir, so D's contexts reach the store at other widths than A's).
  One measurement: two calls on two other small contexts (all --parallel slots) push the context
  off the device; GET confirms `resident: false`; one call (prompt of 1 id, max_tokens 1) brings
  it back; GET reads `last_restore` (its `seconds` is the switch-in latency the server measured,
  its chunk counts say where the chunks came from). Repeated --reps times (default 3); the
  median is reported, every rep is kept in the JSON. Disk reads come from the OS page cache
  where the files are still there (nothing drops caches).

Part 2, throughput (per --kv-compression mode, the default `50%` and `off`; --ctx-size 1024;
each configuration on freshly started replicas and its own Redis database):
  (i)   one replica  --threads 2 --parallel 8, with the context store
  (ii)  two replicas --threads 1 --parallel 4 each, client i always on replica i%2 (sticky)
  (iii) two replicas as in (ii), client i's turn t on replica (i+t)%2 (its context moves every turn)
  (i0)  for reference, one replica --threads 2 --parallel 8 without a context store
  8 client threads, each owning one context and making --turns turns (default 12; prompt of 16
  seeded ids, max_tokens 16, temperature 0). tokens/s = completion tokens summed over all calls /
  wall time from the first call to the last answer; latency = each call's round trip at the
  client. At the end each context is read back (GET) and its token count (and, with a store, its
  revision) checked against the turns that answered 200 (no lost turns); "same as i" counts the
  contexts whose final token ids equal those of configuration (i) of the same mode (the prompts
  are the same; a lossy --kv-compression round trip may change later greedy tokens). 409/429/503
  answers are counted and retried (up to 20 times, 0.2 s apart); other failures are counted and
  not retried.
"""

import argparse
import atexit
import http.client
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

CHILDREN = []  # subprocess.Popen objects this script started
TMP = None


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# processes


def kill_children():
    for p in list(CHILDREN):
        if p.poll() is None:
            try:
                p.terminate()
            except OSError:
                pass
    deadline = time.time() + 5
    for p in list(CHILDREN):
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            try:
                p.kill()
                p.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
    CHILDREN.clear()


def stop(p):
    if p in CHILDREN:
        CHILDREN.remove(p)
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


def on_signal(signum, _frame):
    log(f"signal {signum}: stopping children")
    kill_children()
    sys.exit(128 + signum)


CLK = os.sysconf("SC_CLK_TCK")


def cpu_snapshot(procs):
    """(CPU seconds the whole machine spent busy, CPU seconds of this script and `procs`), from
    /proc: the difference of two snapshots says how much CPU other programs took meanwhile."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(v) - v[3] - (v[4] if len(v) > 4 else 0)) / CLK  # minus idle and iowait
    except (OSError, ValueError):
        return None
    ours = 0.0
    for pid in ["self"] + [str(p.pid) for p in procs]:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ours += (int(fields[11]) + int(fields[12])) / CLK  # utime, stime
        except (OSError, ValueError, IndexError):
            pass
    return busy, ours


def foreign_cpu(a, b):
    if a is None or b is None:
        return None
    return round(max(0.0, (b[0] - a[0]) - (b[1] - a[1])), 2)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_redis():
    port = free_port()
    d = os.path.join(TMP, "redis")
    os.makedirs(d, exist_ok=True)
    out = open(os.path.join(d, "redis.log"), "w")
    p = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--daemonize", "no", "--dir", d, "--databases", "64"],
        stdout=out, stderr=subprocess.STDOUT, cwd=d)
    CHILDREN.append(p)
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return p, port
        except OSError:
            if p.poll() is not None:
                raise SystemExit(f"redis-server exited: {open(out.name).read()[-500:]}")
            time.sleep(0.05)
    raise SystemExit("redis-server did not start")


class Server:
    def __init__(self, args, name, extra):
        self.name = name
        self.argv = [args.bin, "serve", "-m", args.model, "--device", "cpu", "--port", "0",
                     "--shutdown-grace", "2"] + extra
        self.out_path = os.path.join(TMP, f"{name}.out")
        self.err_path = os.path.join(TMP, f"{name}.err")
        self.proc = subprocess.Popen(self.argv, stdout=open(self.out_path, "w"),
                                     stderr=open(self.err_path, "w"), stdin=subprocess.DEVNULL)
        CHILDREN.append(self.proc)
        deadline = time.time() + 120
        self.port = None
        while time.time() < deadline:
            with open(self.out_path) as f:
                first = f.readline()
            if first.startswith("listening on ") and first.endswith("\n"):
                u = urllib.parse.urlparse(first.split()[2])
                self.port = u.port
                break
            if self.proc.poll() is not None:
                raise SystemExit(f"{name} exited {self.proc.returncode}: {' '.join(self.argv)}\n"
                                 f"{open(self.err_path).read()[-2000:]}")
            time.sleep(0.05)
        if self.port is None:
            raise SystemExit(f"{name} did not print its address in 120 s")
        self.local = threading.local()
        # wait for /health
        for _ in range(200):
            try:
                s, _ = self.req("GET", "/health")
                if s == 200:
                    break
            except (OSError, http.client.HTTPException):
                self.local.conn = None
            time.sleep(0.05)
        log(f"{name}: {' '.join(self.argv[1:])}  -> port {self.port}")

    def conn(self):
        c = getattr(self.local, "conn", None)
        if c is None:
            c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
            self.local.conn = c
        return c

    def req(self, method, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(2):
            c = self.conn()
            try:
                c.request(method, path, body=data, headers={"content-type": "application/json"})
                r = c.getresponse()
                raw = r.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                c.close()
                self.local.conn = None
                if attempt:
                    raise
        try:
            js = json.loads(raw) if raw else None
        except ValueError:
            js = {"raw": raw[:300].decode("utf-8", "replace")}
        return r.status, js

    def ok(self, method, path, body=None, want=(200, 201)):
        s, js = self.req(method, path, body)
        if s not in want:
            raise RuntimeError(f"{self.name} {method} {path}: {s} {json.dumps(js)[:400]}")
        return js

    def new_context(self):
        return self.ok("POST", "/v1/contexts", {})["id"]

    def complete(self, ctx, prompt, max_tokens):
        return self.ok("POST", f"/v1/contexts/{ctx}/completions",
                       {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})

    def stop(self):
        stop(self.proc)


# ---------------------------------------------------------------------------------------------
# part 1: switch-in latency


def ids(rng, n):
    return [rng.randint(100, 40000) for _ in range(n)]


def measure_switch_in(srv, ctx, fillers, reps, label):
    rows = []
    for rep in range(reps):
        for f in fillers:  # take every slot with other contexts
            srv.complete(f, [rep + 500], 1)
        before = srv.ok("GET", f"/v1/contexts/{ctx}")
        snap0 = cpu_snapshot(CHILDREN)
        t = time.perf_counter()
        srv.complete(ctx, [321 + rep], 1)
        call_s = time.perf_counter() - t
        snap1 = cpu_snapshot(CHILDREN)
        after = srv.ok("GET", f"/v1/contexts/{ctx}")
        lr = after.get("last_restore") or {}
        row = {
            "resident_before": before.get("resident"),
            "chunk_bits_before": before.get("chunks", {}).get("bits"),
            "seconds": lr.get("seconds"),
            "from_dram": lr.get("chunks_from_dram"),
            "from_disk": lr.get("chunks_from_disk"),
            "from_store": lr.get("chunks_from_store"),
            "recomputed": lr.get("chunks_recomputed"),
            "corrupt": lr.get("chunks_corrupt"),
            "call_s": round(call_s, 6),
            "other_programs_cpu_s": foreign_cpu(snap0, snap1),
            "tokens": after.get("tokens"),
        }
        rows.append(row)
        log(f"  {label} rep {rep}: restore {row['seconds']} s, dram {row['from_dram']} disk "
            f"{row['from_disk']} store {row['from_store']} recomputed {row['recomputed']} "
            f"(resident before: {row['resident_before']}, call {call_s * 1e3:.1f} ms, other "
            f"programs' CPU meanwhile {row['other_programs_cpu_s']} s)")
    secs = [r["seconds"] for r in rows if isinstance(r["seconds"], (int, float))]
    return {
        "median_seconds": statistics.median(secs) if secs else None,
        "median_call_s": statistics.median(r["call_s"] for r in rows),
        "first_seconds": rows[0]["seconds"] if rows else None,
        "reps": rows,
    }


def latency_part(args, redis_port, db, compression):
    store = f"redis://127.0.0.1:{redis_port}/{db}"
    common = ["--threads", "2", "--parallel", "2", "--ctx-size", str(args.ctx_size),
              "--kv-compression", compression, "--context-store", store]
    kvdir = os.path.join(TMP, f"kv-{compression.replace('%', 'pct')}")
    os.makedirs(kvdir, exist_ok=True)
    servers = {}
    result = {"kv_compression": compression, "store": store, "sizes": {}}
    try:
        servers["A"] = Server(args, f"A-dram-{compression}", common)
        servers["D"] = Server(args, f"D-disk-{compression}",
                              common + ["--kv-dram-mem", "1", "--kv-dir", kvdir])
        servers["B"] = Server(args, f"B-store-{compression}", common + ["--kv-dram-mem", "1"])
        result["argv"] = {k: " ".join(s.argv[1:]) for k, s in servers.items()}
        built = {}
        for size in args.sizes:
            for who in ("A", "D"):
                srv = servers[who]
                rng = random.Random(args.seed + size)
                ctx = srv.new_context()
                t = time.perf_counter()
                srv.complete(ctx, ids(rng, size), 1)
                build_s = time.perf_counter() - t
                fillers = [srv.new_context() for _ in range(2)]
                for f in fillers:
                    srv.complete(f, [200, 300, 400, 500], 1)
                built[(who, size)] = ctx
                log(f"{srv.name}: built {size}-token context {ctx} in {build_s:.2f} s")
                result["sizes"].setdefault(str(size), {})[f"build_s_{who}"] = round(build_s, 3)
                tier = "dram" if who == "A" else "disk"
                result["sizes"][str(size)][tier] = measure_switch_in(
                    srv, ctx, fillers, args.reps, f"{compression} {size} {tier}")
        b = servers["B"]
        bfill = [b.new_context() for _ in range(2)]
        for f in bfill:
            b.complete(f, [200, 300, 400, 500], 1)
        for size in args.sizes:
            order = (("A", "store"), ("D", "store_from_D"))
            if args.store_order == "DA":
                order = order[::-1]
            for who, key in order:
                result["sizes"][str(size)][key] = measure_switch_in(
                    b, built[(who, size)], bfill, args.reps,
                    f"{compression} {size} store (built on {who})")
    finally:
        for s in servers.values():
            s.stop()
    return result


# ---------------------------------------------------------------------------------------------
# part 2: throughput


def run_clients(replicas, mode, args, with_store):
    """mode: 'one', 'sticky' or 'moving'. Returns the configuration's figures."""
    nrep = len(replicas)
    n = args.clients
    lat = []
    tokens = [0] * n
    expected = [0] * n  # tokens each context should hold
    ok_turns = [0] * n
    codes = {}
    errors = []
    lock = threading.Lock()
    # contexts: created on the replica of the client's first turn
    ctxs = [replicas[i % nrep].new_context() for i in range(n)]
    start = threading.Barrier(n + 1)

    def client(i):
        rng = random.Random(args.seed * 1000 + i)
        start.wait()
        for t in range(args.turns):
            if mode == "moving":
                srv = replicas[(i + t) % nrep]
            else:
                srv = replicas[i % nrep]
            prompt = ids(rng, args.prompt_tokens)
            body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
            for attempt in range(21):
                t0 = time.perf_counter()
                try:
                    status, js = srv.req("POST", f"/v1/contexts/{ctxs[i]}/completions", body)
                except (OSError, http.client.HTTPException) as e:
                    status, js = f"exc:{type(e).__name__}", None
                dt = time.perf_counter() - t0
                with lock:
                    codes[str(status)] = codes.get(str(status), 0) + 1
                if status in (409, 429, 503) and attempt < 20:
                    time.sleep(0.2)
                    continue
                break
            if status == 200 and isinstance(js, dict) and "usage" in js:
                ct = js["usage"]["completion_tokens"]
                with lock:
                    lat.append(dt)
                tokens[i] += ct
                expected[i] += args.prompt_tokens + ct
                ok_turns[i] += 1
            else:
                with lock:
                    errors.append(f"client {i} turn {t} on {srv.name}: {status} "
                                  f"{json.dumps(js)[:300]}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    procs = [r.proc for r in replicas] + [p for p in CHILDREN if p not in
                                           [r.proc for r in replicas]]
    snap0 = cpu_snapshot(procs)
    start.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    snap1 = cpu_snapshot(procs)

    # read every conversation back (from replica 0, which sees the store's revision when there
    # is one; each context's own replica otherwise)
    lengths_ok = 0
    final = []
    mismatches = []
    for i in range(n):
        srv = replicas[0] if mode != "one" else replicas[i % nrep]
        js = srv.ok("GET", f"/v1/contexts/{ctxs[i]}")
        final.append(js.get("token_ids"))
        # without a store the server keeps no revision (it stays 0): only the lengths count
        good = js.get("tokens") == expected[i] \
            and len(js.get("token_ids") or []) == expected[i] \
            and (not with_store or js.get("revision") == ok_turns[i])
        lengths_ok += good
        if not good:
            mismatches.append({"client": i, "tokens": js.get("tokens"),
                               "expected_tokens": expected[i], "revision": js.get("revision"),
                               "turns_ok": ok_turns[i]})
    total = sum(tokens)
    lat.sort()
    return {
        "wall_s": round(wall, 3),
        "other_programs_cpu_s": foreign_cpu(snap0, snap1),
        "completion_tokens": total,
        "tokens_per_s": round(total / wall, 2) if wall > 0 else None,
        "calls_ok": len(lat),
        "calls_expected": n * args.turns,
        "latency_median_s": round(statistics.median(lat), 4) if lat else None,
        "latency_p90_s": round(lat[min(len(lat) - 1, int(len(lat) * 0.9))], 4) if lat else None,
        "status_counts": codes,
        "errors": errors[:20],
        "contexts_length_ok": f"{lengths_ok}/{n}",
        "length_mismatches": mismatches,
        "_final_token_ids": final,
    }


def warm(replicas):
    for r in replicas:
        r.ok("POST", "/v1/completions", {"prompt": [100, 200, 300], "max_tokens": 2,
                                          "temperature": 0}, want=(200,))


def throughput_part(args, redis_port, compression, db0):
    res = {"kv_compression": compression, "ctx_size": args.tp_ctx_size,
           "clients": args.clients, "turns": args.turns, "prompt_tokens": args.prompt_tokens,
           "max_tokens": args.max_tokens, "configs": {}}
    common = ["--ctx-size", str(args.tp_ctx_size), "--kv-compression", compression]
    configs = [
        ("i: 1 replica, 2 threads, parallel 8", "one", 1, 2, 8, db0),
        ("ii: 2 replicas x 1 thread, parallel 4, sticky", "sticky", 2, 1, 4, db0 + 1),
        ("iii: 2 replicas x 1 thread, parallel 4, moving", "moving", 2, 1, 4, db0 + 2),
        ("i0: 1 replica, 2 threads, parallel 8, no store", "one", 1, 2, 8, None),
    ]
    ref = None
    for rnd in range(args.rounds):
        for name, mode, nrep, threads, parallel, db in configs:
            r = throughput_config(args, redis_port, compression, common, rnd, name, mode, nrep,
                                  threads, parallel, None if db is None else db + 4 * rnd)
            final = r.pop("_final_token_ids", None)
            if final is not None:
                if ref is None:
                    ref = final
                    r["same_tokens_as_i"] = "reference"
                else:
                    same = sum(1 for a, b in zip(ref, final) if a == b)
                    r["same_tokens_as_i"] = f"{same}/{len(final)}"
            log(f"  -> {json.dumps({k: v for k, v in r.items() if k != 'argv'})[:600]}")
            res["configs"].setdefault(name, []).append(r)
    return res


def throughput_config(args, redis_port, compression, common, rnd, name, mode, nrep, threads,
                      parallel, db):
    reps = []
    try:
        for k in range(nrep):
            extra = common + ["--threads", str(threads), "--parallel", str(parallel)]
            if db is not None:
                extra += ["--context-store", f"redis://127.0.0.1:{redis_port}/{db}"]
            tag = compression.replace("%", "pct")
            reps.append(Server(args, f"tp{name.split(':')[0]}-{tag}-r{rnd}-{k}", extra))
        warm(reps)
        log(f"throughput {name}, {compression}, round {rnd + 1}: {args.clients} clients x "
            f"{args.turns} turns")
        r = run_clients(reps, mode, args, db is not None)
        r["round"] = rnd + 1
        r["argv"] = [" ".join(s.argv[1:]) for s in reps]
    except Exception as e:  # report and go on with the next configuration
        r = {"round": rnd + 1, "error": f"{type(e).__name__}: {e}"}
        log(f"throughput {name}: {r['error']}")
    finally:
        for s in reps:
            s.stop()
    return r


# ---------------------------------------------------------------------------------------------
# report


def fmt_ms(s):
    return "-" if s is None else f"{s * 1e3:.1f}"


def sources(rep_rows):
    def agg(key):
        vals = sorted({r[key] for r in rep_rows if r[key] is not None})
        return "/".join(str(v) for v in vals) if vals else "?"
    return (f"dram {agg('from_dram')}, disk {agg('from_disk')}, store {agg('from_store')}, "
            f"recomp {agg('recomputed')}")


def table(report):
    lines = []
    lines.append("Context switch-in latency (restore = server's last_restore.seconds, median of "
                 f"{report['params']['reps']} reps; rep1 = the first rep alone (for Redis: B's "
                 "first sight of the context); call = client round trip of the 1-token call, "
                 "median; other cpu s = CPU seconds other programs used during the measured "
                 "calls, summed over the reps)")
    lines.append(f"{'kv-compression':<15}{'tokens':>7}  {'tier':<22}{'restore ms':>11}"
                 f"{'rep1 ms':>9}{'call ms':>9}{'other cpu s':>12}  "
                 "chunk sources (per rep, distinct values)  resident-before")
    for part in report.get("latency", []):
        if "error" in part:
            lines.append(f"{part['kv_compression']:<15} ERROR {part['error']}")
            continue
        for size, d in part["sizes"].items():
            for tier, label in (("dram", "DRAM (replica A)"), ("disk", "disk (replica D)"),
                                ("store", "Redis (B, A's ctx)"),
                                ("store_from_D", "Redis (B, D's ctx)")):
                m = d.get(tier)
                if not m:
                    continue
                rb = sorted({str(r["resident_before"]) for r in m["reps"]})
                oc = sum(r["other_programs_cpu_s"] or 0 for r in m["reps"])
                lines.append(f"{part['kv_compression']:<15}{size:>7}  {label:<22}"
                             f"{fmt_ms(m['median_seconds']):>11}{fmt_ms(m['first_seconds']):>9}"
                             f"{fmt_ms(m['median_call_s']):>9}{oc:>12.2f}"
                             f"  {sources(m['reps']):<40} {','.join(rb)}")
    for tp in report.get("throughput", []):
        lines.append("")
        lines.append(f"Throughput: {tp['clients']} clients x {tp['turns']} turns, prompt "
                     f"{tp['prompt_tokens']} ids, max_tokens {tp['max_tokens']}, "
                     f"kv-compression {tp['kv_compression']}, ctx-size {tp['ctx_size']}")
        lines.append(f"{'configuration':<50}{'round':>6}{'tok/s':>8}{'wall s':>8}{'med ms':>8}"
                     f"{'p90 ms':>8}  {'lengths ok':<11}{'same as i':<10}{'other cpu s':>12} "
                     "statuses")
        for name, rounds in tp["configs"].items():
          for r in rounds:
            if "error" in r:
                lines.append(f"{name:<50}{r['round']:>6} ERROR {r['error']}")
                continue
            lines.append(f"{name:<50}{r['round']:>6}{r['tokens_per_s']:>8}{r['wall_s']:>8}"
                         f"{fmt_ms(r['latency_median_s']):>8}{fmt_ms(r['latency_p90_s']):>8}"
                         f"  {r['contexts_length_ok']:<11}{r['same_tokens_as_i']:<10}"
                         f"{str(r['other_programs_cpu_s']):>12} {json.dumps(r['status_counts'])}")
    m = report.get("machine", {})
    lines.append("")
    lines.append(f"{m.get('cpus')} CPUs; load average at start {m.get('loadavg_at_start')}, at end "
                 f"{m.get('loadavg_at_end')}; CPU seconds other programs used during the whole "
                 f"run: {m.get('other_programs_cpu_s_whole_run')} (over "
                 f"{report.get('elapsed_s')} s of wall time); 'other cpu s' above: the same during "
                 "each throughput configuration")
    return "\n".join(lines)


def git_head(root):
    try:
        return subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main():
    global TMP
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--bin", default=os.path.join(root, "target/release/gpu-offload"))
    ap.add_argument("--model", default=os.path.expanduser(
        "~/.cache/gpu-offload/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--quick", action="store_true", help="smaller sizes: a smoke run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compression", default="off,50%",
                    help="--kv-compression modes for part 1, comma-separated")
    ap.add_argument("--tp-compression", default="50%,off",
                    help="--kv-compression modes for part 2, comma-separated")
    ap.add_argument("--turns", type=int, default=None, help="turns per client (default 12)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seed", type=int, default=40)
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--store-order", choices=["AD", "DA"], default="AD",
                    help="replica B restores A's context of a size first, then D's (AD), or "
                         "the other way round")
    ap.add_argument("--rounds", type=int, default=2,
                    help="rounds of the throughput configurations, interleaved (default 2)")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--json", help="also write the JSON report here")
    ap.add_argument("--wait-quiet", type=float, default=0, metavar="SECS",
                    help="first wait up to SECS for 5 s in which other programs keep the CPUs "
                         "under 10%% busy (a shared machine)")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.ctx_size = [256, 1024], 1536
        args.reps = min(args.reps, 2)
        args.turns = args.turns or 3
        args.compression = args.compression if args.compression != "off,50%" else "50%"
        args.tp_compression = args.tp_compression if args.tp_compression != "50%,off" else "50%"
    else:
        args.sizes, args.ctx_size = [1024, 4096], 4608
        args.turns = args.turns or 12
    args.prompt_tokens, args.max_tokens, args.tp_ctx_size = 16, 16, 1024
    if not os.path.exists(args.bin):
        raise SystemExit(f"no binary at {args.bin}: cargo build --release")
    if not os.path.exists(args.model):
        raise SystemExit(f"no model at {args.model}")

    TMP = tempfile.mkdtemp(prefix="bench-context-store-")
    atexit.register(lambda: shutil.rmtree(TMP, ignore_errors=True))
    atexit.register(kill_children)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    waited = None
    if args.wait_quiet > 0:
        t0 = time.time()
        while time.time() - t0 < args.wait_quiet:
            a = cpu_snapshot([])
            time.sleep(5)
            b = cpu_snapshot([])
            if a and b and (b[0] - a[0]) - (b[1] - a[1]) < 0.1 * 5 * os.cpu_count():
                waited = round(time.time() - t0, 1)
                break
        log(f"waited {time.time() - t0:.0f} s for a quiet machine "
            f"({'found' if waited is not None else 'not found; going on'})")
    t_start = time.time()
    report = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {"cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg(),
                    "waited_for_quiet_s": waited,
                    "note": "2 replicas x 1 thread vs 1 replica x 2 threads is a like-for-like "
                            "split of the CPUs when the machine has 2 cores; the clients and "
                            "redis share the same cores"},
        "params": {"sizes": args.sizes, "ctx_size": args.ctx_size, "reps": args.reps,
                   "compression": args.compression.split(","),
                   "tp_compression": args.tp_compression.split(","), "seed": args.seed,
                   "turns": args.turns, "clients": args.clients, "rounds": args.rounds,
                   "store_order": args.store_order,
                   "quick": args.quick, "bin": args.bin, "model": args.model},
        "bin_mtime": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(args.bin))),
        "git_head": git_head(root),
    }
    failed = False
    snap_start = cpu_snapshot([])
    try:
        redis, rport = start_redis()
        report["redis"] = f"127.0.0.1:{rport} (redis-server, --save '' --appendonly no)"
        log(f"redis-server on port {rport}; temp dir {TMP}")
        if not args.skip_latency:
            report["latency"] = []
            for k, comp in enumerate(args.compression.split(",")):
                try:
                    report["latency"].append(latency_part(args, rport, k + 1, comp))
                except Exception as e:
                    failed = True
                    log(f"latency part ({comp}) failed: {type(e).__name__}: {e}")
                    report["latency"].append({"kv_compression": comp,
                                              "error": f"{type(e).__name__}: {e}"})
        if not args.skip_throughput:
            report["throughput"] = []
            for k, comp in enumerate(args.tp_compression.split(",")):
                report["throughput"].append(throughput_part(args, rport, comp, 10 + 20 * k))
        # what the store holds at the end
        try:
            s = socket.create_connection(("127.0.0.1", rport), timeout=5)
            s.sendall(b"INFO memory\r\n")
            time.sleep(0.2)
            info = s.recv(65536).decode("utf-8", "replace")
            s.close()
            for line in info.splitlines():
                if line.startswith("used_memory_human:"):
                    report["redis_used_memory_at_end"] = line.split(":", 1)[1].strip()
        except OSError:
            pass
    finally:
        kill_children()
    # the children are gone by now: their CPU time is in this script's cutime/cstime
    try:
        t = os.times()
        ours = t.user + t.system + t.children_user + t.children_system
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(v) - v[3] - (v[4] if len(v) > 4 else 0)) / CLK
        report["machine"]["other_programs_cpu_s_whole_run"] = round(
            max(0.0, busy - snap_start[0] - ours), 1)
    except (OSError, ValueError, TypeError):
        pass
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    report["elapsed_s"] = round(time.time() - t_start, 1)
    report["machine"]["loadavg_at_end"] = os.getloadavg()
    print(json.dumps(report, indent=1))
    print()
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
