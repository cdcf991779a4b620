#include "bench/scenario/runner.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/scenario/app_work.h"
#include "bench/scenario/deferred_report.h"
#include "bench/scenario/host_phases.h"
#include "bench/scenario/processes.h"
#include "bench/scenario/tmemd_log.h"

namespace tmem::scenario {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::vector<std::string> VmsOf(const std::string& scenario) {
  if (scenario == "stream") return {"stream"};
  if (scenario == "reread" || scenario == "idle" || scenario == "phases") {
    return {"reread"};
  }
  return {"stream", "reread"};
}

RunResult Runner::Run(const std::string& scenario, const std::string& mode,
                      int round, const std::string& label) {
  RunResult r;
  r.scenario = scenario;
  r.mode = mode;
  r.round = round;
  // idle: no other tenant, whatever --other-hogs says; phases: one hog
  // per core, switched on and off (host_phases.h).
  r.hogs = scenario == "stream" ? (c_.stream_hogs < 0 ? cpus_ : c_.stream_hogs)
           : scenario == "idle" ? 0
           : scenario == "phases" ? cpus_
                                  : c_.other_hogs;
  // phases: at least two busy and two idle periods.
  const double guest_duration =
      scenario == "phases"
          ? std::max(c_.duration,
                     4 * std::chrono::duration<double>(kPhasePeriod).count())
          : c_.duration;
  const fs::path dir = fs::path(c_.out) / "runs" /
                       absl::StrCat(scenario, "-", mode, "-r", round);
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directories(dir / "sock", ec);
  const std::vector<std::string> vms = VmsOf(scenario);

  // tmemd. adaptive: the synchronous valve; deferred: the same valve with
  // compression left to the idle-priority compactor (deferred compression).
  const std::string tmemd_mode = mode == "none"       ? std::string("off")
                                 : mode == "deferred" ? std::string("adaptive")
                                                      : mode;
  std::vector<std::string> targv = {
      c_.tmemd,
      "--socket-dir",
      (dir / "sock").string(),
      "--memory-cap",
      c_.memory_cap,
      "--mode",
      tmemd_mode,
      absl::StrCat("--deferred-compression=",
                   mode == "deferred" ? "true" : "false"),
      "--cpu-budget",
      absl::StrCat(c_.cpu_budget),
      "--log-format",
      "json",
      "--stats-interval",
      "1"};
  if (c_.workers > 0) {
    targv.emplace_back("--workers");
    targv.emplace_back(absl::StrCat(c_.workers));
  }
  for (const std::string& vm : vms) {
    targv.emplace_back("--vm");
    targv.emplace_back(vm);
  }
  const std::string tlog = (dir / "tmemd.log").string();
  const int tfd = open(tlog.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  const pid_t tmemd = Spawn(targv, tfd, tfd);
  close(tfd);
  bool ready = false;
  for (int i = 0; i < 200 && !ready; ++i) {
    ready = true;
    for (const std::string& vm : vms) {
      if (!fs::exists(dir / "sock" / (vm + ".sock"))) ready = false;
    }
    if (!ready) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  if (!ready) {
    kill(tmemd, SIGKILL);
    struct rusage ru {};
    WaitWithTimeout(tmemd, std::chrono::milliseconds(2000), &ru);
    r.error = "tmemd did not create its sockets (see " + tlog + ")";
    return r;
  }

  std::vector<pid_t> hogs;
  for (int i = 0; i < r.hogs; ++i) hogs.push_back(SpawnHog());
  std::unique_ptr<HostPhases> phases;
  if (scenario == "phases") {
    phases = std::make_unique<HostPhases>(
        hogs, kPhasePeriod, [tmemd] { return ProcCpuSeconds(tmemd); });
  }

  // Guests, stdout through pipes (progress and result lines).
  struct Child {
    std::string vm;
    pid_t pid = -1;
    int fd = -1;
    std::string buf;
    std::string result;
    double mb_per_s = 0;
    int status = 0;
  };
  std::vector<Child> kids(vms.size());
  const double t0_cpu = ProcCpuSeconds(tmemd);
  const Clock::time_point t0 = Clock::now();
  if (phases) phases->Start(t0);
  for (size_t i = 0; i < vms.size(); ++i) {
    Child& k = kids[i];
    k.vm = vms[i];
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) {
      r.error = "pipe failed";
      break;
    }
    double duration = guest_duration;
    // In "both" the streamer outlasts the re-reader's warm-up, so the
    // re-reader is measured with the streamer running throughout.
    if (scenario == "both" && k.vm == "stream") duration += 1.5;
    const std::string elog = (dir / (k.vm + ".stderr")).string();
    const int efd = open(elog.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    // Mode "none": the guest has no tmem at all (no gets either), the
    // baseline of a guest without cleancache.
    std::vector<std::string> gargv = {
        c_.guest,
        "--socket",
        mode == "none" ? std::string()
                       : (dir / "sock" / (k.vm + ".sock")).string(),
        "--corpus",
        corpus_,
        "--workload",
        k.vm,
        "--cache-pages",
        absl::StrCat(c_.cache_pages),
        "--working-set",
        absl::StrCat(c_.working_set),
        "--disk-mbps",
        absl::StrCat(c_.disk_mbps),
        "--readahead-pages",
        absl::StrCat(c_.readahead_pages),
        "--disk-latency-us",
        absl::StrCat(c_.disk_latency_us),
        "--app-passes",
        absl::StrCat(passes_),
        "--duration",
        absl::StrCat(duration),
        "--seed",
        absl::StrCat(round + 1),
        "--progress-ms",
        absl::StrCat(static_cast<int>(c_.progress_s * 1000))};
    k.pid = Spawn(gargv, p[1], efd);
    close(p[1]);
    close(efd);
    k.fd = p[0];
  }

  // Collect lines; print progress.
  Clock::time_point next_print =
      t0 + std::chrono::milliseconds(static_cast<int>(c_.progress_s * 1000));
  size_t open_fds = kids.size();
  // A guest that outlives its duration by this much is hung: kill it (its
  // result line is then missing and the run fails).
  const Clock::time_point deadline =
      t0 + std::chrono::seconds(static_cast<int>(guest_duration) + 60);
  while (open_fds > 0) {
    int wait_ms = 200;
    if (phases) {
      phases->Tick(Clock::now());
      wait_ms = static_cast<int>(std::clamp<int64_t>(
          std::chrono::duration_cast<std::chrono::milliseconds>(
              phases->NextSwitch() - Clock::now())
              .count(),
          1, 200));
    }
    if (Clock::now() > deadline) {
      for (const Child& k : kids) kill(k.pid, SIGKILL);
    }
    std::vector<pollfd> pfds;
    std::vector<size_t> idx;
    for (size_t i = 0; i < kids.size(); ++i) {
      if (kids[i].fd >= 0) {
        pfds.push_back({kids[i].fd, POLLIN, 0});
        idx.push_back(i);
      }
    }
    poll(pfds.data(), pfds.size(), wait_ms);
    for (size_t j = 0; j < pfds.size(); ++j) {
      if ((pfds[j].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      Child& k = kids[idx[j]];
      char buf[4096];
      const ssize_t n = read(k.fd, buf, sizeof(buf));
      if (n <= 0) {
        close(k.fd);
        k.fd = -1;
        --open_fds;
        continue;
      }
      k.buf.append(buf, static_cast<size_t>(n));
      size_t nl;
      while ((nl = k.buf.find('\n')) != std::string::npos) {
        const std::string line = k.buf.substr(0, nl);
        k.buf.erase(0, nl + 1);
        if (line.rfind("progress ", 0) == 0) {
          k.mb_per_s = Num(ParseFlatJson(line), "mb_per_s");
        } else if (line.rfind("result ", 0) == 0) {
          k.result = line;
        }
      }
    }
    const Clock::time_point now = Clock::now();
    if (c_.progress_s > 0 && now >= next_print) {
      next_print +=
          std::chrono::milliseconds(static_cast<int>(c_.progress_s * 1000));
      std::string line =
          absl::StrFormat("  %s %-6s %-8s %5.1fs", label, scenario, mode,
                          std::chrono::duration<double>(now - t0).count());
      for (const Child& k : kids) {
        absl::StrAppendFormat(&line, "  %s %.0f MB/s", k.vm, k.mb_per_s);
      }
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    }
  }
  for (Child& k : kids) {
    struct rusage ru {};
    k.status = WaitWithTimeout(k.pid, std::chrono::milliseconds(10000), &ru);
  }
  const Clock::time_point t1 = Clock::now();
  const double t1_cpu = ProcCpuSeconds(tmemd);
  PhaseTotals phase_totals;
  if (phases) phase_totals = phases->Finish(t1);
  for (pid_t h : hogs) kill(h, SIGKILL);
  for (pid_t h : hogs) {
    waitpid(h, nullptr, 0);
    Untrack(h);
  }

  kill(tmemd, SIGTERM);
  struct rusage tru {};
  const int tstatus =
      WaitWithTimeout(tmemd, std::chrono::milliseconds(10000), &tru);
  r.wall_s = std::chrono::duration<double>(t1 - t0).count();
  r.tmemd_cpu_s = t1_cpu - t0_cpu;
  r.tmemd_cpu_frac = r.tmemd_cpu_s / (r.wall_s * cpus_);
  r.tmemd_total_cpu_s =
      static_cast<double>(tru.ru_utime.tv_sec + tru.ru_stime.tv_sec) +
      static_cast<double>(tru.ru_utime.tv_usec + tru.ru_stime.tv_usec) / 1e6;

  // tmemd's log: per-VM counters, the compactor's, the host's ratio.
  const TmemdLog log = ReadTmemdLog(tlog);
  r.host = DeferredMetrics(log, phases ? &phase_totals : nullptr, cpus_);
  r.ok = r.error.empty();
  if (!WIFEXITED(tstatus) || WEXITSTATUS(tstatus) != 0) {
    r.ok = false;
    r.error =
        absl::StrCat("tmemd exited with status ", tstatus, " (see ", tlog, ")");
  }
  for (Child& k : kids) {
    VmResult v;
    v.vm = k.vm;
    v.guest = ParseFlatJson(k.result);
    if (auto it = log.vm_stats.find(k.vm); it != log.vm_stats.end()) {
      v.tmemd = it->second;
    }
    if (k.result.empty() || !WIFEXITED(k.status) ||
        WEXITSTATUS(k.status) != 0) {
      r.ok = false;
      r.error =
          absl::StrCat("guest ", k.vm, " failed (status ", k.status, "; see ",
                       (dir / (k.vm + ".stderr")).string(), ")");
    }
    if (v.tmemd.empty()) {
      r.ok = false;
      r.error = absl::StrCat("no vm_stats for ", k.vm, " in ", tlog);
    }
    r.vms.push_back(std::move(v));
  }
  return r;
}

}  // namespace tmem::scenario
