#!/usr/bin/env bash
# The GPU smoke test: megatron-core on CUDA, the optimizer offload and the local engine, on one
# node with no network, in under 4 minutes (one H200). Each part runs in its own process under its
# own timeout and appends one JSON line to $OUT/gpu_smoke.jsonl as soon as it finishes (a part
# that times out gets a line saying so); the parts are scripts/gpu/smoke.py's.
#
#   scripts/gpu/smoke.sh            run every part (OUT defaults to ./.rollmesh/gpu_smoke)
#   scripts/gpu/smoke.sh --dry-run  import what the parts use and print the plan; run nothing
#   SMOKE_DEVICE=cpu                run the parts on the CPU (gloo, tiny sizes): the CPU test suite
#   SMOKE_PARTS="models engine"     run only these parts
#   SMOKE_TIMEOUT_<PART>=<s>        a part's timeout (defaults below add up to 240 s)
#   PYTHON                          the interpreter (default python3)
#
# What the device lacks is carried as wheels (no registry there): fetch them on a machine with
# one, into wheels/ at the repository root (not to be committed), and carry it; this script
# installs them into $OUT/site without network. Python 3.12, x86_64:
#
#   pip download --python-version 3.12 --platform manylinux2014_x86_64 --only-binary=:all: \
#       --no-deps -d wheels/ -r scripts/gpu/smoke_requirements.txt
#
# Not verifiable on such a device: the Transformer Engine layer spec (no transformer_engine
# there; the smoke runs megatron-core's local spec with the sdpa core attention) and multi-node
# rendezvous (one node).
set -uo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "${repo_root}"
python="${PYTHON:-python3}"
out="${OUT:-${repo_root}/.rollmesh/gpu_smoke}"
mkdir -p "${out}"
results="${out}/gpu_smoke.jsonl"

# Wheels first: their packages must import before any part runs.
if [[ -d wheels ]] && compgen -G "wheels/*.whl" > /dev/null; then
  timeout "${SMOKE_TIMEOUT_WHEELS:-20}" "${python}" -m pip install --quiet --no-index --no-deps \
    --find-links wheels --target "${out}/site" wheels/*.whl \
    || echo '{"part": "wheels", "ok": false, "error": "pip install from wheels/ failed"}' >> "${results}"
fi
export PYTHONPATH="${repo_root}:${out}/site${PYTHONPATH:+:${PYTHONPATH}}"

if [[ "${1:-}" == "--dry-run" ]]; then
  exec "${python}" scripts/gpu/smoke.py dry_run --out "${out}"
fi

declare -A limits=([models]=25 [megatron_tp1]=60 [megatron_tp2]=50 [offload]=55 [engine]=30)
for part in ${SMOKE_PARTS:-models megatron_tp1 megatron_tp2 offload engine}; do
  variable="SMOKE_TIMEOUT_${part^^}"
  limit="${!variable:-${limits[${part}]:-60}}"
  # -k: a part that ignores SIGTERM (a rank stuck in a collective) is killed 5 s later.
  timeout -k 5 "${limit}" "${python}" scripts/gpu/smoke.py "${part}" --out "${out}"
  status=$?
  if [[ ${status} -eq 124 || ${status} -eq 137 ]]; then
    printf '{"part": "%s", "ok": false, "error": "timed out after %s s"}\n' "${part}" "${limit}" >> "${results}"
  elif [[ ${status} -ne 0 ]]; then
    printf '{"part": "%s", "ok": false, "error": "exited with %s"}\n' "${part}" "${status}" >> "${results}"
  fi
done
echo "results: ${results}"
