# Sourced by the scripts that run Python: sets PYTHON to the interpreter to use, from the repository
# root. PYTHON given: that one. Else .venv/bin/python when `make setup` has made it, else a python3 on
# PATH that can import torch (with this checkout on PYTHONPATH). Else one line saying what to do.
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then
        PYTHON=.venv/bin/python
    elif command -v python3 >/dev/null && python3 -c "import torch, hydra" 2>/dev/null; then
        PYTHON=python3
        export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "${0##*/}: no Python with torch and hydra here: run 'make setup' first (it creates .venv), or set PYTHON=" >&2
        exit 2
    fi
fi
