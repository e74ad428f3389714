#!/usr/bin/env python3
"""Issue 39's hostile probes of the server and the CLI's inputs, counted by outcome: clean error,
panic (rc 101), signal, hang, wrong output. Run it against a binary before and after a fix:

    scripts/hostile-serve-probes.py --bin target/release/gpu-offload --model stories260K-f32.gguf

Every child runs under a 4 GiB address-space cap and a timeout. The server's deadlines are set
through the environment (1 s head, 2 s idle and body), so an older binary starts too.
"""

import argparse
import json
import os
import resource
import socket
import subprocess
import tempfile
import time
from collections import Counter, defaultdict

TABLE = defaultdict(Counter)


def cap():
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def env():
    e = {k: v for k, v in os.environ.items() if not k.startswith("GPU_OFFLOAD_")}
    e.update(GPU_OFFLOAD_HEADER_TIMEOUT="1", GPU_OFFLOAD_IDLE_TIMEOUT="2", GPU_OFFLOAD_BODY_TIMEOUT="2")
    return e


def cli(a, args, timeout=60):
    try:
        p = subprocess.run([a.bin] + args, capture_output=True, text=True, errors="replace",
                           timeout=timeout, preexec_fn=cap, env=env())
    except subprocess.TimeoutExpired:
        return "hang", ""
    if p.returncode == 101:
        return "panic", p.stderr
    if p.returncode < 0:
        return "signal", p.stderr
    return p.returncode, p.stdout + p.stderr


def record(probe, outcome):
    TABLE[probe][outcome] += 1


def read_all(s, limit=15):
    s.settimeout(limit)
    buf = b""
    try:
        while True:
            d = s.recv(65536)
            if not d:
                return buf, True
            buf += d
    except ConnectionResetError:
        return buf, True
    except socket.timeout:
        return buf, False


def answer(buf):
    head, _, body = buf.partition(b"\r\n\r\n")
    status = int(head.split()[1]) if head.startswith(b"HTTP/") else 0
    if b"chunked" in head.lower():
        out, rest = b"", body
        while b"\r\n" in rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size.strip() or b"0", 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2:]
        body = out
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


def raw(addr, data, limit=15):
    s = socket.create_connection(addr)
    try:
        s.sendall(data)
    except OSError:
        pass
    buf, closed = read_all(s, limit)
    s.close()
    return buf, closed


def post(addr, path, body):
    b = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(b)}\r\nconnection: close\r\n\r\n"
    buf, _ = raw(addr, head.encode() + b, 120)
    return answer(buf)


def is_json_error(v):
    return isinstance(v, dict) and isinstance(v.get("error"), dict)


def server_probes(a, n):
    p = subprocess.Popen([a.bin, "serve", "--model", a.model, "--port", "0", "--device", "cpu",
                          "--threads", "1", "--ctx-size", "512"], stdout=subprocess.PIPE, text=True,
                         preexec_fn=cap, env=env())
    line = p.stdout.readline()
    host, port = line.split("//")[-1].strip().split(":")
    addr = (host, int(port))
    try:
        for _ in range(n):
            _, closed = raw(addr, b"", 15)
            record("silent connection", "clean error" if closed else "hang")
        for _ in range(max(1, n // 2)):
            s = socket.create_connection(addr)
            t = time.time()
            closed = False
            for b in b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-slow: " * 10:
                try:
                    s.send(bytes([b]))
                except OSError:
                    closed = True
                    break
                s.settimeout(0.3)
                try:
                    if s.recv(1 << 16) == b"":
                        closed = True
                        break
                except socket.timeout:
                    pass
                except OSError:
                    closed = True
                    break
                if time.time() - t > 15:
                    break
            s.close()
            record("byte-dripping head", "clean error" if closed else "hang")
        for _ in range(max(1, n // 2)):
            buf, closed = raw(addr, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"p", 15)
            st, v = answer(buf)
            record("stalled body", "hang" if not closed else "clean error" if is_json_error(v) else "wrong output")
        for _ in range(n):
            buf, _ = raw(addr, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 3000000\r\nconnection: close\r\n\r\n")
            st, v = answer(buf)
            record("body over the limit (413)", "clean error" if st == 413 and is_json_error(v) else "wrong output")
        for _ in range(n):
            buf, _ = raw(addr, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\nzz\r\n{}\r\n0\r\n\r\n")
            st, v = answer(buf)
            record("malformed chunked body", "clean error" if st == 400 and is_json_error(v) else "wrong output")
        for i in range(n):
            body = {"prompt": "Once", "max_tokens": 0} if i % 2 else {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}
            st, v = post(addr, "/v1/completions" if i % 2 else "/v1/chat/completions", body)
            record("max_tokens 0", "clean error" if st == 400 and is_json_error(v) else "wrong output")
        for i in range(n):
            body = {"prompt": "Once", "max_tokens": 1}
            if i % 2:
                body["stop"] = ["x" * 5000]
            else:
                body["logit_bias"] = {str(t): 1 for t in range(500)}
            st, v = post(addr, "/v1/completions", body)
            record("stop 5000 B / logit_bias 500 keys", "clean error" if st == 400 and is_json_error(v) else "wrong output")
        for i in range(n):
            body = {"prompt": "abcdefgh" * 250000, "max_tokens": 1} if i % 2 else \
                {"messages": [{"role": "user", "content": "abcdefgh" * 250000}], "max_tokens": 1}
            st, v = post(addr, "/v1/completions" if i % 2 else "/v1/chat/completions", body)
            ok = st == 400 and is_json_error(v) and "at least" in v["error"]["message"]
            record("2 MB prompt (refused unencoded)", "clean error" if ok else "encoded in full" if st == 400 else "wrong output")
        for _ in range(n):
            st, v = post(addr, "/v1/contexts", {"system_prompt": "Once upon a time there was a girl. " * 60})
            record("system prompt that never fits", "clean error" if st == 400 else "wrong output")
        st, v = post(addr, "/v1/completions", {"prompt": "Once", "max_tokens": 2})
        record("server still answers", "ok" if st == 200 else "wrong output")
    finally:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()


def cli_probes(a, n):
    m = ["--device", "cpu", "--threads", "1", "-m", a.model]
    d = tempfile.mkdtemp()
    def outcome(rc, out, needle):
        if isinstance(rc, str):
            return rc
        if rc == 1 and needle in out:
            return "clean error"
        if rc == 1 and ("memory" in out.lower() or "allocat" in out.lower()):
            return "memory exhausted (4 GiB cap)"
        return "wrong output"

    for _ in range(n):
        rc, out = cli(a, ["run"] + m + ["-p", "Once", "-n", "18446744073709551615"])
        record("run -n u64::MAX", outcome(rc, out, "overflow"))
        rc, out = cli(a, ["run"] + m + ["--prompt-file", "/dev/zero", "-n", "1"])
        record("run --prompt-file /dev/zero", outcome(rc, out, "max_file_read_bytes"))
        rc, out = cli(a, ["prefill"] + m + ["-q", "-i", "/dev/zero", "-o", f"{d}/z.jsonl"])
        record("prefill -i /dev/zero", outcome(rc, out, "neither a regular file"))
        good = f"{d}/good.jsonl"
        with open(good, "wb") as f:
            f.write(b'{"id":"a","prompt":"Once"}\n')
        rc, out = cli(a, ["prefill"] + m + ["-q", "-i", good, "-o", good])
        record("prefill -o equal to -i", outcome(rc, out, "is the input"))
        inp = f"{d}/in.jsonl"
        with open(inp, "wb") as f:
            f.write(b'{"id":"a","prompt":"Once"}\n{"id":"b","prompt":"\xff"}\n{"id":"c","file":"/dev/zero"}\n')
        o = f"{d}/out.jsonl"
        if os.path.exists(o):
            os.remove(o)
        rc, out = cli(a, ["prefill"] + m + ["-q", "-i", inp, "-o", o])
        lines = [json.loads(l) for l in open(o)] if os.path.exists(o) else []
        ids = {l["id"]: l for l in lines}
        utf8_ok = rc == 0 and "line 2" in ids.get("line:2", {}).get("error", "") and "a" in ids
        record("prefill JSONL invalid UTF-8 line", "clean error" if utf8_ok else rc if isinstance(rc, str) else "wrong output")
        zero_ok = rc == 0 and "max_file_read_bytes" in ids.get("c", {}).get("error", "")
        record('prefill record {"file": "/dev/zero"}', "clean error" if zero_ok else rc if isinstance(rc, str) else "wrong output")
        kv = f"{d}/kv{_}"
        rc, out = cli(a, ["prefill"] + m + ["-q", "-i", good, "-o", f"{d}/kvout{_}.jsonl", "--save-contexts", kv])
        for root, _dirs, files in os.walk(kv):
            if "index.json" in files:
                os.remove(f"{root}/index.json")
                os.symlink("/dev/zero", f"{root}/index.json")
        try:
            p = subprocess.Popen([a.bin, "serve"] + m + ["--port", "0", "--kv-dir", kv], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, preexec_fn=cap, env=env())
            line = p.stdout.readline()
            p.terminate()
            _o, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            line, err = "", ""
        ok = line.startswith("listening") and "max_file_read_bytes" in err
        record("context index linked to /dev/zero", "clean error" if ok else "signal" if p.returncode and p.returncode < 0 else "wrong output")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("-n", type=int, default=6)
    a = ap.parse_args()
    server_probes(a, a.n)
    cli_probes(a, max(1, a.n // 2))
    total = Counter()
    for probe, c in TABLE.items():
        print(f"{probe:40s} " + ", ".join(f"{k}: {v}" for k, v in sorted(c.items(), key=str)))
        total.update(c)
    print(f"{'total':40s} " + ", ".join(f"{k}: {v}" for k, v in sorted(total.items(), key=str)))


if __name__ == "__main__":
    main()
