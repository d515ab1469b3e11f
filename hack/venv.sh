#!/usr/bin/env bash
# Prints the path of a Python virtual environment with the project's runtime and dev dependencies,
# creating it on first use. It lives outside the repo, keyed by pyproject.toml, so a fresh clone
# reuses it and an edit of the dependencies builds a new one. The checkout itself is not installed
# into it: callers put the repo root on PYTHONPATH, so one venv serves any checkout.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${SHARING_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gpu-sharing}
python=${PYTHON:-python3}
# The key covers only what is installed (the dependency lists and the Python version), so editing
# tool settings in pyproject.toml does not rebuild the environment.
requirements=$("$python" - "$root/pyproject.toml" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["dev"]))
PY
)
key=$( { echo "$requirements"; "$python" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-12)
venv=$cache/venv-$key
if [ ! -f "$venv/.complete" ]; then
  echo "creating the Python environment in $venv (first run: about a minute)" >&2
  rm -rf "$venv"
  mkdir -p "$cache"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --upgrade pip >&2
  echo "$requirements" > "$venv/requirements.txt"
  "$venv/bin/python" -m pip install --quiet -r "$venv/requirements.txt" >&2
  touch "$venv/.complete"
fi
echo "$venv"
