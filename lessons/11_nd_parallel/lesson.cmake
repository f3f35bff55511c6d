# Lesson 11: N-D parallelism. Composes lesson 08's tensor-parallel blocks, lesson 09's pipeline and
# lesson 10's context-parallel attention (their reference solutions) on one dtc::Mesh; links
# dtc::dist (gloo; NCCL on CUDA builds).
dtc_add_lesson(11 DIR 11_nd_parallel SOURCES nd.cpp GIVEN nd_given.cpp DRIVER program.cpp
               TESTS tests/lesson11/nd_test.cpp tests/lesson11/program_test.cpp
               LIBS dtc::dist lesson01_solution_lib lesson08_solution_lib lesson09_solution_lib
               lesson10_solution_lib TORCH)

# End-to-end: the real program on real processes through this path's torchrun, against the
# losses and parameter digest of lesson 02's single-process run of the same model (tied, the
# default; untied where asked). dp 2 x tp 2 x pp 2 and tp 2 x pp 2 x cp 2 (ring, zig-zag, sequence
# parallelism) on 8
# processes (the primary path: 8 LibTorch processes on 2 cores are the slowest start of the suite),
# and interleaved pp 2 x v 2 x dp 2 under ZeRO-1 (the optimizer sharded over dp) on 4 processes on
# both paths. hsdp: ZeRO-3 over pairs of the 4 dp ranks, replicated across the pairs, x tp 2
# (--hsdp). two_nodes: ZeRO-3 x dp 2 x tp 2 x pp 2 on two "nodes" of 4 (lesson 04's network
# namespaces, scripts/two-nodes.sh): pp is the slowest dimension, so each node holds one stage and
# only the stages' traffic crosses between them (skipped where namespaces cannot be made).
set(l11_model --steps 3 --layers 4 --hidden 32 --heads 2 --seq 16)
string(JOIN " " l11_model_args ${l11_model})
if(DTC_TORCHRUN)
  dtc_add_e2e(11 NAME torchrun_dp2_tp2_pp2 TIMEOUT 180 PRIMARY COMMAND ${DTC_E2E_RUN} --nproc 8
    --program @PROGRAM@ --json-equals dp=2 --json-equals tp=2 --json-equals pp=2
    # the closed form, plus at most two messages of 4 b s h = 2,048 bytes received ahead
    --json-gap memory.measured.activations-memory.closed_form.activations=0:4096
    --losses-like $<TARGET_FILE:lesson02_solution> "--losses-like-args=${l11_model_args}"
    -- ${l11_model} --mix 2x2x2x1 --json)
  # --trace DIR, tp 2 x pp 2: the blocks' and the optimizer's spans, and the tp and pp groups'
  # collectives and messages, on one clock across each group.
  dtc_add_e2e(11 NAME torchrun_trace TIMEOUT 120 PRIMARY COMMAND ${DTC_E2E_RUN} --nproc 4
    --program @PROGRAM@ --trace-check "step,fwd block,bwd block,optimizer" --trace-groups tp,pp
    --losses-like $<TARGET_FILE:lesson02_solution> "--losses-like-args=${l11_model_args}"
    -- ${l11_model} --mix 1x2x2x1 --json)
  # Interleaved 1F1B on 4 stages x 2 chunks, m = 8: replayed from the trace with F = 1, B = 2
  # and free messages, every stage idles (p-1)/(vm+p-1), with the executor's waits and without.
  set(l11_bubble_model --steps 2 --layers 8 --hidden 32 --heads 2 --seq 16)
  string(JOIN " " l11_bubble_args ${l11_bubble_model})
  dtc_add_e2e(11 NAME bubble TIMEOUT 120 PRIMARY COMMAND ${DTC_E2E_RUN} --nproc 4
    --program @PROGRAM@ --trace-check "step" --trace-bubble
    --losses-like $<TARGET_FILE:lesson02_solution> "--losses-like-args=${l11_bubble_args}"
    -- ${l11_bubble_model} --mix 1x1x4x1:0:none:1:2 --json)
  dtc_add_e2e(11 NAME two_nodes TIMEOUT 180 PRIMARY SKIP_RETURN_CODE 77 COMMAND ${DTC_E2E_RUN}
    --nproc 8 --launcher two-nodes --two-nodes-script "${PROJECT_SOURCE_DIR}/scripts/two-nodes.sh"
    --program @PROGRAM@ --json-equals world=8 --json-equals dp=2 --json-equals tp=2
    --json-equals pp=2 --json-equals zero_stage=3
    --losses-like $<TARGET_FILE:lesson02_solution> "--losses-like-args=${l11_model_args}"
    -- ${l11_model} --mix 2x2x2x1:3 --json)
  dtc_add_e2e(11 NAME torchrun_hsdp2_tp2 TIMEOUT 180 PRIMARY COMMAND ${DTC_E2E_RUN} --nproc 8
    --program @PROGRAM@ --json-equals dp=4 --json-equals hsdp=2 --json-equals zero_stage=3
    --json-equals tp=2
    --losses-like $<TARGET_FILE:lesson02_solution> "--losses-like-args=${l11_model_args}"
    -- ${l11_model} --mix 4x2x1x1 --hsdp 2 --json)
  dtc_add_e2e(11 NAME torchrun_tp2_pp2_cp2 TIMEOUT 180 PRIMARY COMMAND ${DTC_E2E_RUN} --nproc 8
    --program @PROGRAM@ --json-equals cp=2 --json-equals zigzag=true
    --json-equals sequence_parallel=true
    --losses-like $<TARGET_FILE:lesson02_solution> "--losses-like-args=${l11_model_args}"
    -- ${l11_model} --mix 1x2x2x2 --zigzag --sequence-parallel --json)
  dtc_add_e2e(11 NAME torchrun_interleaved_dp2 TIMEOUT 120 COMMAND ${DTC_E2E_RUN} --nproc 4
    --program @PROGRAM@ --json-equals pp=2 --json-equals virtual_stages=2
    "--json-equals=schedule=\"interleaved\"" --json-equals zero_stage=1
    --losses-like $<TARGET_FILE:lesson02_solution>
    "--losses-like-args=${l11_model_args} --untied"
    -- ${l11_model} --untied --mix 2x1x2x1:1:none:1:2 --json)
endif()

# A smoke run (not the benchmark itself) of bench/lesson11_vs_pytorch.py: dp 2 x tp 2 x pp 2 on 8
# ranks, tiny sizes (--smoke: 3 steps, 2 layers, hidden 32, seq 16), ours against PyTorch's
# FSDP2 x DTensor TP x pipelining. Primary path only: it needs the venv's PyTorch 2.x
# (torch.distributed.pipelining and fully_shard; Debian's 1.13 has neither). Exit 1 when a side
# fails or the losses differ. The real run: python bench/lesson11_vs_pytorch.py.
if(DTC_TORCHRUN AND DTC_FLAVOR STREQUAL "primary")
  get_filename_component(_l11_bin "${DTC_TORCHRUN}" DIRECTORY)
  add_test(NAME lesson11.solution.bench_smoke
    COMMAND "${_l11_bin}/python" "${PROJECT_SOURCE_DIR}/bench/lesson11_vs_pytorch.py"
            --binary $<TARGET_FILE:lesson11_solution> --torchrun "${DTC_TORCHRUN}" --smoke)
  set_tests_properties(lesson11.solution.bench_smoke PROPERTIES
    ENVIRONMENT DTC_ZYGOTE_WORKERS=1
    LABELS "lesson11;solution;lesson11-solution" TIMEOUT 120)
endif()
