"""A small GGUF v3 reader/writer for crafting hostile variants of our own test models
(scripts/hostile-probes.py). Written from the format's description; standard library only."""

import struct

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
          BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}


class Reader:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def take(self, fmt):
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self):
        n = self.take("<Q")
        s = self.buf[self.pos:self.pos + n]
        self.pos += n
        return s.decode("utf-8", "replace")

    def value(self, t):
        if t in SCALAR:
            return self.take(SCALAR[t])
        if t == STRING:
            return self.string()
        if t == ARRAY:
            et, n = self.take("<I"), self.take("<Q")
            return (et, [self.value(et) for _ in range(n)])
        raise ValueError(f"type {t}")


class Gguf:
    """kv: list of [key, type, value] (arrays as (elem_type, list)); tensors: list of
    [name, dims, ggml_type, data bytes]."""

    def __init__(self, path):
        buf = open(path, "rb").read()
        r = Reader(buf)
        assert buf[:4] == b"GGUF"
        r.pos = 4
        self.version = r.take("<I")
        nt, nkv = r.take("<Q"), r.take("<Q")
        self.kv = []
        for _ in range(nkv):
            k = r.string()
            t = r.take("<I")
            self.kv.append([k, t, r.value(t)])
        infos = []
        for _ in range(nt):
            name = r.string()
            nd = r.take("<I")
            dims = [r.take("<Q") for _ in range(nd)]
            infos.append((name, dims, r.take("<I"), r.take("<Q")))
        self.alignment = self.get("general.alignment") or 32
        start = (r.pos + self.alignment - 1) // self.alignment * self.alignment
        self.header_end = start
        offs = sorted(o for _, _, _, o in infos) + [len(buf) - start]
        self.tensors = []
        for name, dims, t, o in infos:
            end = next(x for x in offs if x > o)
            self.tensors.append([name, dims, t, buf[start + o:start + end]])

    def get(self, key):
        for k, _, v in self.kv:
            if k == key:
                return v
        return None

    def set(self, key, t, v):
        for e in self.kv:
            if e[0] == key:
                e[1], e[2] = t, v
                return
        self.kv.append([key, t, v])

    def drop(self, key):
        self.kv = [e for e in self.kv if e[0] != key]

    def tensor(self, name):
        return next(t for t in self.tensors if t[0] == name)

    def arch(self):
        return self.get("general.architecture")


def put_value(out, t, v):
    if t in SCALAR:
        out += struct.pack(SCALAR[t], v)
    elif t == STRING:
        b = v.encode() if isinstance(v, str) else v
        out += struct.pack("<Q", len(b)) + b
    elif t == ARRAY:
        et, items = v
        out += struct.pack("<IQ", et, len(items))
        for x in items:
            put_value(out, et, x)
    else:
        raise ValueError(t)


def write(g, path, tensor_count=None, kv_count=None, offsets=None):
    """Writes g; the counts and offsets can be overridden to lie about the file."""
    out = bytearray(b"GGUF")
    out += struct.pack("<I", g.version)
    out += struct.pack("<QQ", len(g.tensors) if tensor_count is None else tensor_count,
                       len(g.kv) if kv_count is None else kv_count)
    for k, t, v in g.kv:
        put_value(out, STRING, k)
        out += struct.pack("<I", t)
        put_value(out, t, v)
    pos, offs = 0, []
    for _, _, _, data in g.tensors:
        offs.append(pos)
        pos = (pos + len(data) + g.alignment - 1) // g.alignment * g.alignment
    for i, (name, dims, t, _) in enumerate(g.tensors):
        put_value(out, STRING, name)
        out += struct.pack("<I", len(dims))
        for d in dims:
            out += struct.pack("<Q", d)
        off = offs[i] if offsets is None or offsets[i] is None else offsets[i]
        out += struct.pack("<IQ", t, off)
    out += b"\0" * ((-len(out)) % g.alignment)
    for i, (_, _, _, data) in enumerate(g.tensors):
        out += data
        out += b"\0" * ((-len(out)) % g.alignment)
    with open(path, "wb") as f:
        f.write(out)
