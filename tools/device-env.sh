# Sourced by tools/gpu-run and tools/gpu-steps, with $root set to the project root: on a machine
# that cannot download, unpack the CuTe DSL from .cute/cute-dsl.tar.xz (../shared/tools/cute-dsl-pack)
# and install the wheels of .whl/ (../shared/tools/device-wheels: TVM-FFI and the anchors) into
# /tmp/site, on PYTHONPATH. Where neither exists, nothing changes. Once a machine: a stamp names
# the contents installed, so a later call on the same (warm) machine skips the minute of
# unpacking, and scripts started side by side wait on one lock instead of installing over one
# another (two pip installs into one target failed with "File exists").
course_env_sources=$(ls "$root"/.cute/cute-dsl.tar.xz "$root"/.whl/*.whl 2>/dev/null)
if [ -n "$course_env_sources" ]; then
  mkdir -p /tmp/site
  stamp=/tmp/site/.installed-$(md5sum $course_env_sources | cut -d' ' -f1 | md5sum | cut -c1-16)
  (
    flock 9
    if [ ! -f "$stamp" ]; then
      installed=1  # the stamp only after every step succeeded: a failed one is tried again
      if [ -f "$root/.cute/cute-dsl.tar.xz" ]; then
        tar -xJf "$root/.cute/cute-dsl.tar.xz" -C /tmp/site || installed=0
      fi
      if compgen -G "$root/.whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
          "$root"/.whl/*.whl || installed=0
      fi
      [ $installed = 0 ] || touch "$stamp"
    fi
  ) 9>/tmp/site.lock
  if [ -f "$root/.cute/cute-dsl.tar.xz" ]; then
    export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
  fi
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
