# Sourced (bash) by scripts/gpu-check.sh: finds NVRTC, cuBLAS and NCCL as
# installed (the CUDA toolkit, or the nvidia-* wheels PyTorch brings), CUDA 12
# or 13, and links each under the CUDA 12 sonames cudarc opens in the folder
# $CULIBS (default target/culibs), which it puts first on LD_LIBRARY_PATH;
# the calls dplc makes are the same in both versions. Sets DPLC_NVRTC_LIB
# when NVRTC was found. Says on stderr what it found.
CULIBS="${CULIBS:-$PWD/target/culibs}"
mkdir -p "$CULIBS"
_search=()
if command -v python3 >/dev/null; then
    while IFS= read -r d; do _search+=("$d"); done < <(python3 - <<'PY' 2>/dev/null
import site, os
for p in site.getsitepackages() + [site.getusersitepackages()]:
    for sub in ("nvidia", "torch/lib"):
        d = os.path.join(p, sub)
        if os.path.isdir(d):
            print(d)
PY
)
fi
_search+=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu /usr/local/nvidia/lib64 /usr/local/nvidia/lib)
_find_lib() {
    local name d f
    for name in "$@"; do
        for d in "${_search[@]}"; do
            [[ -d "$d" ]] || continue
            f="$(find -L "$d" -maxdepth 5 -name "$name" \( -type f -o -type l \) 2>/dev/null | sort | head -1)"
            if [[ -n "$f" ]]; then
                readlink -f "$f"
                return 0
            fi
        done
    done
    return 1
}
_lib_dirs=""
_link_lib() {
    local what="$1" found
    shift
    if found="$(_find_lib "$@")"; then
        ln -sf "$found" "$CULIBS/lib$what.so"
        ln -sf "$found" "$CULIBS/lib$what.so.12"
        _lib_dirs+=":$(dirname "$found")"
        echo "$what: $found" >&2
    else
        echo "$what: not found (searched ${_search[*]})" >&2
    fi
}
_link_lib nvrtc libnvrtc.so.12 libnvrtc.so.13 'libnvrtc.so.1[0-9]*'
_link_lib cublas libcublas.so.12 libcublas.so.13 'libcublas.so.1[0-9]*'
_link_lib nccl libnccl.so.2 'libnccl.so*'
export LD_LIBRARY_PATH="$CULIBS${_lib_dirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [[ -e "$CULIBS/libnvrtc.so.12" ]]; then
    export DPLC_NVRTC_LIB="$CULIBS/libnvrtc.so.12"
fi
unset -f _find_lib _link_lib
unset _search _lib_dirs
