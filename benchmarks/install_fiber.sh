#!/bin/sh
# Installs Uber Fiber 0.2.1 (a benchmark peer, never a fibrl dependency) into its own venv,
# benchmarks/.fiber-venv, for benchmarks/bench_envs.py. Needs root for apt-get.
set -eu
VENV="${1:-$(dirname "$0")/.fiber-venv}"
apt-get install -y libnanomsg-dev
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q nnpy psutil docker cloudpickle kubernetes requests click gymnasium
"$VENV/bin/pip" install -q --no-deps fiber==0.2.1
"$VENV/bin/python" -c "import fiber; print('fiber', fiber.__version__, 'in', '$VENV')"
