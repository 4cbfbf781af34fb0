#!/usr/bin/env bash
# One GPU loan's checks (issue 54), prepared so that a single call measures everything docs/benchmarks-gpu.md
# needs: the CUDA tests, int4 against float16 at Llama-3.2-3B shapes, the GPU's int4 kernel's top-1
# agreement with the CPU's on real weights, lossless decoding on the demo model, the step against
# transformers' eager and compiled generate, and the step with each layer compiled. Each part runs under its own
# timeout (seconds), its log in $OUT (the device tool's folder that comes back; default .work/gpu-session);
# a part that fails or times out does not stop the next. Prints each part's tail and the tables.
#
#   bash tools/gpu_session.sh               # on the GPU: at most 8 min 5 s (the parts' timeouts)
#   SMOKE=1 bash tools/gpu_session.sh       # the same parts at tiny sizes on the CPU (its test)
#   PARTS="step compile" bash tools/gpu_session.sh   # some parts only (tests int4 agree demo lossless step compile)
#
# On the device machine (2026-11-29: its plain `python` is not the one with torch, polygraphy is missing, at
# most 8 files come back from $OUT, and a call killed at its 600 s limit returned nothing at all): carry
# polygraphy's wheel (`pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
# --platform manylinux2014_x86_64 -d .whl polygraphy`, `.whl` in .git/info/exclude and in the call's carry),
# install it with the device README's line, then, with timeout_s 600 (the tables also print as it ends):
#   OUT=/tmp/gs bash tools/gpu_session.sh; cp /tmp/gs/gpu-session.tgz "$OUT"/
# (the script packs its logs and tables into one gpu-session.tgz; the artifacts it builds go elsewhere).
set -u
out=${OUT:-.work/gpu-session}
mkdir -p "$out"
work=$(mktemp -d)  # the artifacts the parts build: not in $OUT, which comes back
py=python  # the interpreter that has torch: on the device machine that is python3, not python
python -c "import torch" 2> /dev/null || py=python3
if [ "${SMOKE:-0}" = 1 ]; then
    device=cpu; archs=tiny-random; big=tiny-random; batches="1"; rounds=1; tokens=4
    tests="tests/runtime/test_torch_quantized.py -k quantize_makes"; lossless="--device cpu --count 2"
else
    device=cuda; archs="smollm2-360m llama-3.2-1b"; big=llama-3.2-3b; batches="1 8"; rounds=2; tokens=32
    tests="tests/runtime/test_cuda_graphs.py tests/runtime/test_torch_backend.py tests/runtime/test_torch_quantized.py"
    lossless="--device cuda"
fi
bench="$py -m tools.bench.gpu --device $device --max-new-tokens $tokens --rounds $rounds"
[ "$device" = cpu ] && bench="$bench --prompt 4 --bandwidth-mib 16 --dtype float32"

part() {  # part NAME LIMIT COMMAND...: run it (unless PARTS names others), keep its log, say how it ended
    local name=$1 limit=$2
    shift 2
    case " ${PARTS:-$name} " in *" ${name%%-*} "*|*" $name "*) ;; *) return ;; esac
    echo "== $name (timeout ${limit}s): $*"
    local began=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "   exit $rc after $((SECONDS - began)) s$([ $rc = 124 ] && echo ': timed out')"
    tail -n 25 "$out/$name.log"
}

date -u +"%Y-%m-%dT%H:%M:%SZ $(git rev-parse --short HEAD 2>/dev/null)" | tee "$out/when.txt"
$py -c "import torch, transformers; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'transformers', transformers.__version__)" | tee -a "$out/when.txt"
# (the longest parts last; all of them together within the device tool's 600 s a call)
part tests 75 $py -m pytest -q -rs $tests
# weight-only int4 (and int8) against float16, batch 1, the shapes a Jetson's memory-bound regime meets
part int4 60 $bench --arch $big --batch 1 --speedups 1 2 --weights float int8 int4 --no-transformers --out "$out/int4.md"
# the GPU's int4 kernel against the CPU's on real (the demo model's) weights: top-1 agreement, 100 E2E prompts
part agree 50 bash -c "$py -m export build --out '$work/demo-int4' --weights int4 --dtype float16 -q && \
    $py -m tools.evaluate.agreement --reference '$work/demo-int4' --model $device=$work/demo-int4 --backend torch \
    --device $device --text data/e2e/devset.csv.gz --column mr --prompts 100 --deterministic --int4-kernel onnxruntime"
# lossless decoding on the demo model, torch backend, batch 1 and 8
part demo 20 $py -m export build --out "$work/demo" -q
part lossless 60 $py -m tools.bench.lossless "$work/demo" --backend torch $lossless --batch 1 8 --speedups 2 5 \
    --rounds 2 --out "$out/lossless.md"
# the step at full depth and under SkipDecode, beside transformers' generate, eager and compiled; a shape a part
for arch in $archs; do
    part "step-$arch" 80 $bench --arch $arch --batch $batches --speedups 1 2 5 --peer eager compiled \
        --out "$out/step-$arch.md"
done
# the graph steps with each layer compiled by torch.compile beside them (the first shape only: compiles)
part compile 60 $bench --arch ${archs%% *} --batch $batches --speedups 1 2 --no-transformers --compile-steps \
    --out "$out/compile.md"
for table in "$out"/*.md; do
    echo "== $(basename "$table")"
    cat "$table"
done
tar czf "$out/gpu-session.tgz" -C "$out" --exclude=gpu-session.tgz . && rm -r "$work"
exit 0
