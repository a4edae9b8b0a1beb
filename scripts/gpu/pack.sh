#!/usr/bin/env bash
# Run here, with network: put into .whl/ (git-ignored) the wheels of every package pipe needs on
# the GPU machine that its image lacks, for CPython 3.12 on manylinux x86_64, so that
# scripts/gpu/run.sh can install them there with no network.
#
# 1. Resolve pipe's dependencies with the fp8, serve and hf extras for that platform, with
#    torch pinned to the image's 2.11.0 (pip install --dry-run --report: nothing is installed).
# 2. Keep the packages the image does not have (scripts/gpu/image_packages.txt) and download
#    each as a wheel, no dependencies (the resolution already named them all).
# 3. Check: every wheel installs with --no-index --no-deps into a Python 3.12 target, and the
#    wheels plus this checkout fit the 64 MiB a device call carries.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
WHEELS="$ROOT/.whl"
LIMIT_MIB=64
PLATFORM=(--python-version 3.12 --implementation cp --abi cp312 --only-binary=:all:)
for n in $(seq 5 39); do PLATFORM+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORM+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
PLATFORM+=(--platform linux_x86_64 --platform any)
PIP=("$PYTHON" -m pip --disable-pip-version-check)
WORK="$(mktemp -d)"; echo "[pack] work folder $WORK"
trap '[ -n "${PACK_KEEP:-}" ] || rm -rf "$WORK"' EXIT

echo "[pack] resolving pipe-llm[fp8,serve,hf] for CPython 3.12, manylinux x86_64, torch 2.11.0"
"$PYTHON" - "$WORK/requirements.txt" <<'PY'
import re, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
wanted = list(project["dependencies"])
for extra in ("fp8", "serve", "hf"):
    wanted += project["optional-dependencies"][extra]
wanted = [w for w in wanted if re.split(r"[ <>=!~;\[]", w)[0] != "torch"] + ["torch==2.11.0"]
open(sys.argv[1], "w").write("\n".join(wanted) + "\n")
PY
"${PIP[@]}" install -q --dry-run --ignore-installed --report "$WORK/report.json" \
    --target "$WORK/resolve" "${PLATFORM[@]}" -r "$WORK/requirements.txt" 2>&1 \
    | grep -v "is ignored: it is neither" || true
test -s "$WORK/report.json" || { echo "[pack] resolution failed" >&2; exit 1; }

"$PYTHON" - "$WORK/report.json" scripts/gpu/image_packages.txt "$WORK/missing.txt" <<'PY'
import json, re, sys
def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()
resolved = {norm(i["metadata"]["name"]): i["metadata"]["version"]
            for i in json.load(open(sys.argv[1]))["install"]}
image = {norm(line.strip()) for line in open(sys.argv[2]) if line.strip() and line[0] != "#"}
missing = sorted(n for n in resolved if n not in image)
open(sys.argv[3], "w").write("".join(f"{n}=={resolved[n]}\n" for n in missing))
print(f"[pack] {len(resolved)} packages resolved, {len(resolved) - len(missing)} in the image; "
      f"carrying {len(missing)}: {', '.join(missing)}")
PY

rm -rf "$WHEELS"
mkdir -p "$WHEELS"
"${PIP[@]}" download -q --no-deps "${PLATFORM[@]}" -d "$WHEELS" -r "$WORK/missing.txt" 2>&1 \
    | grep -v "is ignored: it is neither" || true
test "$(ls "$WHEELS"/*.whl | wc -l)" -eq "$(wc -l < "$WORK/missing.txt")" \
    || { echo "[pack] some wheels were not downloaded" >&2; exit 1; }

echo "[pack] checking that the wheels install with --no-index --no-deps into a 3.12 target"
"${PIP[@]}" install -q --dry-run --no-index --no-deps --target "$WORK/check" "${PLATFORM[@]}" \
    "$WHEELS"/*.whl

wheels_kib=$(du -sk "$WHEELS" | cut -f1)
tree_kib=$(git ls-files -z --cached --others --exclude-standard | du -ck --files0-from=- \
    2>/dev/null | tail -1 | cut -f1)
total_mib=$(( (wheels_kib + tree_kib) / 1024 ))
echo "[pack] .whl: $(ls "$WHEELS" | wc -l) wheels, $((wheels_kib / 1024)) MiB; with the" \
    "checkout ($((tree_kib / 1024)) MiB) $total_mib MiB of the $LIMIT_MIB MiB a call carries"
if [ "$total_mib" -ge "$LIMIT_MIB" ]; then
    echo "[pack] too large to carry in one call" >&2
    exit 1
fi
echo "[pack] done: name .whl in the device call's carry and run: bash scripts/gpu/run.sh"
