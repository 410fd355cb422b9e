#!/usr/bin/env bash
# Install kvpush into a Neuron DLAMI virtualenv without replacing anything the DLAMI put there.
#
#   scripts/neuron_install.sh VENV SRC [EXTRAS]
#
# VENV: the DLAMI's vLLM virtualenv (e.g. /opt/aws_neuronx_venv_pytorch_inference_vllm_0_24_0_1_1_0).
# SRC: a kvpush source tree (its pyproject.toml lists the requirements). EXTRAS: e.g. "bench".
#  1. writes a constraints file pinning every distribution already in VENV to its installed version
#     (CONSTRAINTS, default VENV/kvpush-constraints.txt), so pip can add packages but never change one;
#  2. installs kvpush's requirements except the names in scripts/neuron-protected.txt (NIXL, torch,
#     vLLM, the Neuron packages), with those constraints;
#  3. installs kvpush itself with --no-deps (KVPUSH_DIST overrides what is installed, default SRC);
#  4. checks that every protected distribution has the version it had before.
# A protected requirement missing from VENV (e.g. no nixl) is an error: this script never fetches one.
# DRY_RUN=1: pip runs with --dry-run and writes its reports (REPORT_DIR, default a temporary folder):
# deps.json and kvpush.json; nothing is installed. pip's own settings apply (PIP_INDEX_URL,
# PIP_NO_INDEX, PIP_FIND_LINKS, ...).
set -euo pipefail

if [ $# -lt 2 ] || [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
  exit 2
fi
VENV=$1
SRC=$2
EXTRAS=${3:-}
HERE=$(cd "$(dirname "$0")" && pwd)
PROTECTED=${PROTECTED:-$HERE/neuron-protected.txt}
CONSTRAINTS=${CONSTRAINTS:-$VENV/kvpush-constraints.txt}
KVPUSH_DIST=${KVPUSH_DIST:-$SRC}
PY=$VENV/bin/python

die() {
  echo "neuron_install.sh: $*" >&2
  exit 1
}

[ -x "$PY" ] || die "$PY not found: VENV must be a virtualenv"
[ -f "$SRC/pyproject.toml" ] || die "$SRC/pyproject.toml not found: SRC must be a kvpush source tree"
[ -f "$PROTECTED" ] || die "$PROTECTED not found"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
REPORT_DIR=${REPORT_DIR:-$WORK}

# name==version of every distribution in VENV; the protected ones also go to protected-before.txt.
"$PY" - "$PROTECTED" "$CONSTRAINTS" "$WORK/protected-before.txt" <<'PYEOF'
import re
import sys
from importlib.metadata import distributions


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


protected_file, constraints, before = sys.argv[1:4]
protected = {norm(ln.split("#")[0].strip()) for ln in open(protected_file) if ln.split("#")[0].strip()}
pins = {}
for dist in distributions():
    name = dist.metadata["Name"]
    if name:
        pins[norm(name)] = dist.version
with open(constraints, "w") as fh:
    fh.write("# written by scripts/neuron_install.sh: what this venv held before kvpush was installed\n")
    fh.writelines(f"{n}=={v}\n" for n, v in sorted(pins.items()))
with open(before, "w") as fh:
    fh.writelines(f"{n}=={v}\n" for n, v in sorted(pins.items()) if n in protected)
PYEOF

# kvpush's requirements (with EXTRAS), split into protected (must already be in VENV) and the rest.
"$PY" - "$SRC/pyproject.toml" "$EXTRAS" "$PROTECTED" "$CONSTRAINTS" "$WORK/requirements.txt" <<'PYEOF'
import re
import sys

try:
    import tomllib
except ImportError:
    sys.exit("neuron_install.sh: needs Python >= 3.11 in the venv (tomllib) to read pyproject.toml")

pyproject, extras, protected_file, constraints, out = sys.argv[1:6]


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def req_name(req):
    return norm(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1))


project = tomllib.load(open(pyproject, "rb"))["project"]
optional = project.get("optional-dependencies", {})


def expand(extra, seen):
    """An extra's requirements, with kvpush's own extras (`kvpush[nixl,plot]`) expanded in place."""
    if extra not in optional:
        sys.exit(f"neuron_install.sh: kvpush has no extra {extra!r}")
    out = []
    for req in optional[extra]:
        own = re.match(r"\s*kvpush\[([^\]]*)\]\s*$", req)
        if not own:
            out.append(req)
            continue
        for sub in filter(None, (e.strip() for e in own.group(1).split(","))):
            if sub not in seen:
                seen.add(sub)
                out += expand(sub, seen)
    return out


reqs = list(project.get("dependencies", []))
seen = set()
for extra in filter(None, (e.strip() for e in extras.split(","))):
    if extra not in seen:
        seen.add(extra)
        reqs += expand(extra, seen)
reqs = list(dict.fromkeys(reqs))
protected = {norm(ln.split("#")[0].strip()) for ln in open(protected_file) if ln.split("#")[0].strip()}
installed = {ln.split("==")[0]: ln.split("==")[1].strip() for ln in open(constraints) if "==" in ln}
missing = []
with open(out, "w") as fh:
    for req in reqs:
        name = req_name(req)
        if name not in protected:
            fh.write(req + "\n")
        elif name in installed:
            print(f"keeping the venv's {name} {installed[name]} (kvpush asks for {req.strip()})")
        else:
            missing.append(req.strip())
if missing:
    sys.exit(
        "neuron_install.sh: kvpush needs " + ", ".join(missing) + " and the venv has none; this script never "
        "installs them into a DLAMI venv (they would bring another NIXL or torch). Use the DLAMI's vLLM venv, "
        "which ships NIXL, or install them yourself knowing what they replace"
    )
PYEOF

if [ "${DRY_RUN:-0}" = "1" ]; then
  "$PY" -m pip install --quiet --dry-run --report "$REPORT_DIR/deps.json" -c "$CONSTRAINTS" -r "$WORK/requirements.txt"
  "$PY" -m pip install --quiet --dry-run --report "$REPORT_DIR/kvpush.json" --no-deps -c "$CONSTRAINTS" "$KVPUSH_DIST"
  echo "dry run: pip reports in $REPORT_DIR (deps.json, kvpush.json)"
  exit 0
fi

"$PY" -m pip install --quiet -c "$CONSTRAINTS" -r "$WORK/requirements.txt"
"$PY" -m pip install --quiet --no-deps -c "$CONSTRAINTS" "$KVPUSH_DIST"

"$PY" - "$PROTECTED" "$WORK/protected-before.txt" <<'PYEOF'
import re
import sys
from importlib.metadata import distributions


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


protected_file, before_file = sys.argv[1:3]
protected = {norm(ln.split("#")[0].strip()) for ln in open(protected_file) if ln.split("#")[0].strip()}
before = set(open(before_file).read().split())
after = {f"{norm(d.metadata['Name'])}=={d.version}" for d in distributions() if d.metadata["Name"]}
after = {p for p in after if p.split("==")[0] in protected}
if before != after:
    sys.exit(f"neuron_install.sh: protected distributions changed: before {sorted(before)}, after {sorted(after)}")
print("protected distributions unchanged: " + (", ".join(sorted(before)) or "none installed"))
PYEOF
