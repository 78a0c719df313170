# Sourced on a lent GPU machine from the repository root, with .dev/ carried there
# (scripts/device/prepare.sh made it): libfuse3 unpacked under /tmp/fuse, pyfuse3
# compiled with the machine's gcc, the wheels into /tmp/site; then PYTHONPATH runs the
# checkout's distorefs with the image's numpy, numba and torch. The device tool starts
# each machine bare: source this at the start of every call.
D=$PWD/.dev
mkdir -p /tmp/fuse /tmp/site/pyfuse3
for f in "$D"/deb/*.deb; do dpkg -x "$f" /tmp/fuse; done
export PATH=/tmp/fuse/bin:/tmp/fuse/usr/bin:$PATH LD_LIBRARY_PATH=/tmp/fuse/lib/x86_64-linux-gnu
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$D"/whl/*.whl || return 1
(cd "$D/pyfuse3" && gcc -shared -fPIC -O2 -DFUSE_USE_VERSION=32 $(python3-config --includes) -I/tmp/fuse/usr/include/fuse3 \
    -IInclude -Isrc/pyfuse3 src/pyfuse3/__init__.c -L/tmp/fuse/lib/x86_64-linux-gnu -l:libfuse3.so.3 -lpthread -lrt \
    -o "/tmp/site/pyfuse3/__init__$(python3-config --extension-suffix)" && cp src/pyfuse3/_pyfuse3.py src/pyfuse3/asyncio.py /tmp/site/pyfuse3/) || return 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/spy "$D"/whl2/*.whl && export PATH=/tmp/spy/bin:$PATH
# (GNU nproc honours OMP_NUM_THREADS: it prints 1 below, not the machine's cores)
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
python3 -c 'import pyfuse3, trio, crc32c, zstandard, cpprb; print("pyfuse3 noflush", hasattr(pyfuse3.FileInfo(), "noflush"))' || return 1
