# Sourced by the GPU scripts: install the wheels carried in .whl/ (the cuDNN frontend the GPU machine lacks; FlagGems for
# the Triton peer) into /tmp/cudnn_moe_site with --no-index, and put that folder and this checkout on PYTHONPATH.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/cudnn_moe_site .whl/*.whl || return 1
  export PYTHONPATH=/tmp/cudnn_moe_site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
