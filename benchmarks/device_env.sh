# Sourced by the device_*.sh scripts, on the device machine, in the repository root: installs
# the carried wheels (.whl/) and the project itself into /tmp/site, laid out as
# pyproject.toml's package-dir maps it (no build needed), and puts /tmp/site on PYTHONPATH.
: "${OUT:?set OUT to the folder whose files come back}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
rm -rf /tmp/site/taso_jax && cp -r taso_jax /tmp/site/taso_jax
for sub in ops verify search; do cp -r "$sub" "/tmp/site/taso_jax/$sub"; done
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
