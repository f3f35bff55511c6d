# Lesson 12: failures at scale. A distributed checkpoint (checkpoint.cpp) of lesson 11's N-D
# training (lesson11_solution_lib: its mesh, groups and NdTrainer), a resume on any mesh, and
# torchrun restarts. zlib's CRC-32 checks every saved piece.
find_package(ZLIB REQUIRED)
dtc_add_lesson(12 DIR 12_fault_tolerance SOURCES checkpoint.cpp
               GIVEN checkpoint_given.cpp state_given.cpp DRIVER program.cpp
               TESTS tests/lesson12/checkpoint_test.cpp tests/lesson12/resume_test.cpp
                     tests/lesson12/program_test.cpp
               LIBS dtc::dist lesson11_solution_lib ZLIB::ZLIB TORCH)

# End-to-end: the real program under torchrun (tests/lesson12/e2e_restart.py). A rank killed
# (SIGKILL of its own process) at step 3 of 5, a checkpoint every 2 steps: torchrun restarts the
# job (--max_restarts=1), which resumes from step 2 and ends with the losses and parameter digest
# of the run that never failed, bit for bit. elastic: 4 ranks (dp 2 x pp 2) save step 2, 2 ranks
# of tp 2 resume from it, each reading its slices (within fp32 rounding of the straight run).
set(l12_model --layers 4 --hidden 32 --heads 2 --seq 16)
if(DTC_TORCHRUN)
  set(l12_e2e Python3::Interpreter "${PROJECT_SOURCE_DIR}/tests/lesson12/e2e_restart.py"
      --torchrun "${DTC_TORCHRUN}" "--torchrun-flags=${_dtc_e2e_flags}" ${_dtc_e2e_port0})
  dtc_add_e2e(12 NAME torchrun_restart_elastic TIMEOUT 240 PRIMARY COMMAND ${l12_e2e}
    --program @PROGRAM@ --nproc 4 --mix 2x1x2x1 --steps 5 --every 2 --fail-at-step 3
    --fail-rank 2 --elastic-nproc 2 --elastic-mix 1x2x1x1 --elastic-step 2 -- ${l12_model})
  # A rank that stops communicating at step 3 (tp 2 x pp 2): the others' collectives time out
  # after 3 s, they exit, torchrun restarts the job, which resumes from step 2.
  dtc_add_e2e(12 NAME torchrun_hang TIMEOUT 180 PRIMARY COMMAND ${l12_e2e}
    --program @PROGRAM@ --nproc 4 --mix 1x2x2x1 --steps 4 --every 2 --fail-at-step 3
    --fail-rank 3 --hang -- ${l12_model})
  # Two "nodes" of 2 ranks (lesson 04's network namespaces) save step 2 of dp 2 x pp 2; one node of
  # 2 ranks, tp 2, resumes (skipped where namespaces cannot be made).
  dtc_add_e2e(12 NAME two_nodes_to_one TIMEOUT 240 PRIMARY SKIP_RETURN_CODE 77 COMMAND
    Python3::Interpreter "${PROJECT_SOURCE_DIR}/tests/lesson12/e2e_two_nodes.py"
    --e2e-run "${PROJECT_SOURCE_DIR}/tests/support/e2e_run.py"
    --two-nodes-script "${PROJECT_SOURCE_DIR}/scripts/two-nodes.sh"
    --torchrun "${DTC_TORCHRUN}" "--torchrun-flags=${_dtc_e2e_flags}" ${_dtc_e2e_port0}
    --program @PROGRAM@ --baseline $<TARGET_FILE:lesson02_solution>
    --mix 2x1x2x1 --resume-mix 1x2x1x1 -- ${l12_model})
  # One job of torchrun --nnodes=1:2 on the two "nodes": node1 lost after step 5's commit, node0's
  # ranks restarted alone (dp 4 to dp 2), resumed from step 5.
  dtc_add_e2e(12 NAME lose_a_node TIMEOUT 240 PRIMARY SKIP_RETURN_CODE 77 COMMAND
    Python3::Interpreter "${PROJECT_SOURCE_DIR}/tests/lesson12/e2e_two_nodes.py"
    --e2e-run "${PROJECT_SOURCE_DIR}/tests/support/e2e_run.py"
    --two-nodes-script "${PROJECT_SOURCE_DIR}/scripts/two-nodes.sh"
    --torchrun "${DTC_TORCHRUN}" "--torchrun-flags=${_dtc_e2e_flags}" ${_dtc_e2e_port0}
    --program @PROGRAM@ --baseline $<TARGET_FILE:lesson02_solution> --lose-node1 -- ${l12_model})
  # Both paths: ZeRO-1 over dp 2, rank 1 killed at step 2 (right after the checkpoint of step 2).
  dtc_add_e2e(12 NAME torchrun_restart_zero1 TIMEOUT 180 COMMAND ${l12_e2e}
    --program @PROGRAM@ --nproc 2 --mix 2x1x1x1:1 --steps 4 --every 2 --fail-at-step 2
    --fail-rank 1 -- ${l12_model})
endif()
