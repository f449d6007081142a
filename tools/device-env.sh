# Sourced by tools/gpu-run and tools/gpu-steps, with $root set to the project root: on a machine
# that cannot download, unpack the CuTe DSL from .cute/cute-dsl.tar.xz (../shared/tools/cute-dsl-pack)
# and install the wheels of .whl/ (../shared/tools/device-wheels: TVM-FFI and the anchors) into
# /tmp/site, on PYTHONPATH. Where neither exists, nothing changes.
if [ -f "$root/.cute/cute-dsl.tar.xz" ]; then
  mkdir -p /tmp/site && tar -xJf "$root/.cute/cute-dsl.tar.xz" -C /tmp/site
  export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
fi
if compgen -G "$root/.whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$root"/.whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
