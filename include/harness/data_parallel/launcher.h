// Starting data-parallel workers like torchrun does, and failing like it: either this process is
// one worker of a launch done elsewhere (torchrun's or Slurm's variables), or it starts N copies
// of itself, forwards their output, and stops them all as soon as one fails.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace harness::data_parallel {

struct WorkerEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "localhost";
  int master_port = 11868;
  // torchrun's TORCHELASTIC_USE_AGENT_STORE: the agent serves the rendezvous store at
  // MASTER_PORT for every restart, so rank 0 connects to it instead of serving one, and the keys
  // of each attempt (TORCHELASTIC_RESTART_COUNT) get a prefix of their own, as torch does.
  bool use_agent_store = false;
  int restart_count = 0;
};

// From torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (RANK set: WORLD_SIZE is
// required, LOCAL_RANK defaults to RANK, the address and port to localhost/11868), else from
// Slurm's SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID with MASTER_ADDR (and MASTER_PORT, default
// 11868). nullopt when neither launched this process (a single-task Slurm step without
// MASTER_ADDR counts as not launched). Malformed or inconsistent values throw
// std::invalid_argument naming the variable and its value.
std::optional<WorkerEnv> worker_env_from(const std::map<std::string, std::string>& env);
std::optional<WorkerEnv> worker_env_from_environment();

// Output forwarding: a worker's line is printed as it is when it already says which rank it is
// from (it contains "Rank <r>" or "rank <r>" as a word, or starts with "[rank"), else with the
// prefix "[rank r] ". Returns the line to print.
std::string label_worker_line(int rank, const std::string& line);

// Set in a replacement worker (LaunchOptions::max_replacements): its launch id, past the world.
inline constexpr const char* kElasticJoinIdVariable = "HARNESS_ELASTIC_JOIN_ID";

struct LaunchOptions {
  std::string executable = "/proc/self/exe";
  // Extra variables for the workers, on top of this process's environment and the five above.
  std::vector<std::pair<std::string, std::string>> extra_env;
  // After the first failure: SIGTERM to the others, SIGKILL after this long.
  std::chrono::milliseconds kill_grace = std::chrono::seconds(5);
  // Where forwarded lines go (stderr lines with is_stderr). Default: this process's stdout/stderr.
  // If it throws, the exception leaves run_workers after every worker was killed and reaped.
  std::function<void(int rank, bool is_stderr, const std::string& line)> sink;
  // A worker stopped by a signal (SIGSTOP, ...), or one that exited 0 while others keep running,
  // for longer than this ends the launch, named as the cause; a failure of another rank meanwhile
  // names it too. Programs set it a little above their collective timeout, after which the other
  // ranks fail on their own.
  std::chrono::milliseconds unresponsive_worker_timeout = std::chrono::seconds(330);
  // The launcher serves the rendezvous store (a TCPStore at master_port) itself, as torchrun's
  // agent does, instead of rank 0: the workers are told so (TORCHELASTIC_USE_AGENT_STORE=1) and
  // connect to it, so that no worker's death takes the store with it. Under
  // launch_with_restarts one store serves every attempt, each attempt's keys under a prefix of
  // its own. A port that cannot be served throws std::runtime_error naming --master_port.
  bool serve_store = false;
  // --elastic (with serve_store): a worker that dies (by a signal or a non-zero exit, or stopped
  // past unresponsive_worker_timeout and then killed) is lost, not the end of the run: the
  // launcher says so on stderr, records it in the store (elastic_rendezvous.h's
  // lost_process_key, the reason as the value) and lets the others go on; one that exits 0 early
  // is not waited for. The launch fails when no worker exits 0 (LaunchResult::lost lists them).
  bool elastic = false;
  // Under elastic: how many lost workers the launcher replaces. For each lost worker (a
  // replacement included), while fewer than this many were started, it starts a new process with
  // the lost one's RANK and LOCAL_RANK (its device) and a launch id of its own, world_size,
  // world_size + 1, ... in kElasticJoinIdVariable, under which it joins the run
  // (elastic_rendezvous.h). Its lines are labelled with that id. 0: none.
  int max_replacements = 0;
  // Which attempt of launch_with_restarts this is (the workers' store keys are under its prefix).
  int restart_count = 0;
  // Fault injection for tests: called before the launcher's "pipe2" and "fork" for each rank; a
  // non-zero return is taken as that call failing with this errno.
  std::function<int(const char* call, int rank)> fail_system_call;
};

struct LaunchResult {
  int exit_code = 0;            // 0 when every worker exited 0
  std::string failure;          // "rank 1 exited with status 3", "rank 1 was killed by signal 9 (SIGKILL)"
  std::vector<pid_t> pids;      // the workers' process ids, by rank (all reaped on return)
  std::vector<int> wait_status; // each worker's waitpid status, by rank
  bool interrupted = false;     // the launcher itself received SIGINT or SIGTERM
  std::vector<int> lost;        // under elastic: the ranks lost while the others went on, in order
  // Under elastic with max_replacements: each replacement started, in order (its launch id, past
  // the world, and the RANK it took); their pids follow the world's in pids.
  struct Replacement {
    int id = 0;
    int rank = 0;
    bool operator==(const Replacement& o) const { return id == o.id && rank == o.rank; }
  };
  std::vector<Replacement> replacements;
};

// Starts world_size copies of options.executable with argv_of_self (argv[0] first) and RANK,
// WORLD_SIZE, LOCAL_RANK (= rank), MASTER_ADDR, MASTER_PORT set; each worker runs in its own
// process group and dies with the launcher (PR_SET_PDEATHSIG, so call this from a thread that
// outlives the workers). Waits for all. When one exits non-zero or is killed, the others get
// SIGTERM, then SIGKILL after kill_grace; SIGINT/SIGTERM to the launcher do the same. No worker,
// zombie or pipe is left on return, whether it returns or throws (a failed pipe2 or fork, a
// throwing sink): the workers already started are killed and reaped first.
LaunchResult run_workers(const std::vector<std::string>& argv_of_self, int world_size,
                         const std::string& master_addr, int master_port,
                         const LaunchOptions& options = {});

// run_workers with default options; prints the failure to stderr and returns the exit code.
int launch_workers(const std::vector<std::string>& argv_of_self, int world_size,
                   const std::string& master_addr, int master_port);

// torchrun's --max-restarts: runs the group; when a worker fails (not when the launcher itself is
// interrupted), stops the group and starts it again, up to max_restarts times, the restarted
// workers with `--resume auto` (any --resume of argv_of_self replaced) and
// TORCHELASTIC_RESTART_COUNT set as torchrun sets it. Returns the last attempt's exit code.
int launch_with_restarts(const std::vector<std::string>& argv_of_self, int world_size,
                         const std::string& master_addr, int master_port, int max_restarts,
                         const LaunchOptions& options = {});

// argv with every "--resume X" / "--resume=X" replaced by one "--resume auto" at the end.
std::vector<std::string> with_resume_auto(const std::vector<std::string>& argv_of_self);

}  // namespace harness::data_parallel
