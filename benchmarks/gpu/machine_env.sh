# Sourced by run_suite.sh and lease_check.sh from the repo's root: the wheels that travel in .whl/ (what the GPU
# machine lacks, diffusers and its small needs) installed into /tmp/site, and this checkout on the path.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
