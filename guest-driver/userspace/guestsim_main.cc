// tmem-guestsim: plays one or more guests against tmemd, connecting to each
// VM's ivshmem socket exactly as QEMU does and speaking the ring ABI as the
// guest kernel module does. One socket is one VM (tmemd's server takes one
// client per socket), so each --socket gets one guest thread.
//
// Exit status: 0 success; 1 the coherency check saw a wrong page; 2 a
// usage, connect or attach error.
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "guest-driver/userspace/ivshmem_client.h"
#include "guest-driver/userspace/tmem_guest.h"
#include "guest-driver/userspace/workloads.h"
#include "host-agent/common/json_text.h"

namespace tmem {
namespace {

struct Options {
  std::vector<std::string> sockets;
  int guests = 0;  // 0: one per socket
  std::string workload = "seq";
  uint64_t pages = 4096;
  uint64_t ops = 100'000;
  uint64_t seed = 1;
  std::string shared_uuid;
  std::string report = "text";
  int vectors = 1;
  int connect_timeout_ms = 5000;
  int get_timeout_us = 50'000;
  int progress_ms = 1000;
  // After the workload, stay attached (pools and stored pages kept) until
  // SIGTERM or SIGINT: a guest whose pages outlive its workload.
  bool hold = false;
  // SIGTERM or SIGINT end the workload early (then report and exit): a
  // guest that runs for as long as a test needs it, whatever the machine's
  // speed.
  bool stop_on_signal = false;
};

// Set by SIGTERM/SIGINT while holding (a lock-free atomic: signal-safe).
std::atomic<bool> g_release{false};
static_assert(std::atomic<bool>::is_always_lock_free);

void OnReleaseSignal(int /*sig*/) {
  g_release.store(true, std::memory_order_relaxed);
}

struct GuestRun {
  std::string socket;
  absl::Status status;  // connect / attach / pool failure
  WorkloadResult result;
  GuestCounters counters;
};

std::optional<TmemGuest::Uuid> ParseUuid(const std::string& text) {
  TmemGuest::Uuid uuid{};
  size_t n = 0;
  int high = -1;
  for (char c : text) {
    if (c == '-') continue;
    int v;
    if (c >= '0' && c <= '9') {
      v = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      v = c - 'a' + 10;
    } else if (c >= 'A' && c <= 'F') {
      v = c - 'A' + 10;
    } else {
      return std::nullopt;
    }
    if (high < 0) {
      high = v;
      continue;
    }
    if (n == uuid.size()) return std::nullopt;
    uuid[n++] = static_cast<uint8_t>(high << 4 | v);
    high = -1;
  }
  if (n != uuid.size() || high >= 0) return std::nullopt;
  return uuid;
}

void RunGuest(const Options& opt, const WorkloadConfig& config, GuestRun* run,
              std::atomic<uint64_t>* progress) {
  IvshmemClientOptions client_options;
  client_options.vectors = opt.vectors;
  client_options.timeout = std::chrono::milliseconds(opt.connect_timeout_ms);
  absl::StatusOr<std::unique_ptr<IvshmemClient>> client =
      IvshmemClient::Connect(run->socket, client_options);
  if (!client.ok()) {
    run->status = client.status();
    return;
  }
  TmemGuestOptions guest_options;
  guest_options.get_timeout = std::chrono::microseconds(opt.get_timeout_us);
  absl::StatusOr<std::unique_ptr<TmemGuest>> guest =
      TmemGuest::Create(client->get(), guest_options);
  if (!guest.ok()) {
    run->status =
        absl::Status(guest.status().code(),
                     absl::StrCat("attaching to the region behind ",
                                  run->socket, ": ", guest.status().message()));
    return;
  }
  // The workload's thread is the only one using the client, so it may read
  // the socket: a hang-up means tmemd went away, and waiting on a dead host
  // would only turn every get into a timeout.
  WorkloadConfig checked = config;
  IvshmemClient* c = client->get();
  checked.health_check = [c] { return c->PollServer(); };
  run->result = RunWorkload(**guest, checked, progress,
                            opt.stop_on_signal ? &g_release : nullptr);
  run->status = run->result.status;
  // Let in-flight completions land so the counters are final.
  for (int i = 0; i < 100 && (*guest)->in_flight() > 0; ++i) {
    (*guest)->Poll();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  run->counters = (*guest)->counters();
  if (opt.hold && run->status.ok()) {
    // The line the caller waits for: the workload is done, the pages stay.
    std::fprintf(stderr, "tmem-guestsim: %s: holding until SIGTERM\n",
                 run->socket.c_str());
    while (!g_release.load(std::memory_order_relaxed)) {
      (*guest)->Poll();
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
}

double Rate(double n, double seconds) { return seconds > 0 ? n / seconds : 0; }

std::string JsonCounters(const GuestCounters& c) {
  std::string out = "{";
  bool first = true;
  for (const auto& [name, value] : CounterList(c)) {
    absl::StrAppend(&out, first ? "" : ", ", "\"", std::string(name),
                    "\": ", value);
    first = false;
  }
  return out + "}";
}

std::string JsonRun(const WorkloadResult& r, const GuestCounters& c,
                    double seconds) {
  return absl::StrCat(
      "\"ops\": ", r.ops, ", \"puts\": ", r.puts, ", \"gets\": ", r.gets,
      ", \"hits\": ", r.hits, ", \"invalidates\": ", r.invalidates,
      ", \"verified_hits\": ", r.verified_hits,
      ", \"mismatches\": ", r.mismatches, ", \"seconds\": ", seconds,
      ", \"ops_per_sec\": ", Rate(static_cast<double>(r.ops), seconds),
      ", \"put_mb_per_sec\": ",
      Rate(static_cast<double>(c.puts_sent) * TMEM_PAGE_SIZE / 1e6, seconds),
      ", \"counters\": ", JsonCounters(c));
}

void PrintJson(const Options& opt, const std::vector<GuestRun>& runs,
               const WorkloadResult& total, const GuestCounters& total_c,
               double wall) {
  std::string out =
      absl::StrCat(R"({"workload": ")", opt.workload, R"(", "pages": )",
                   opt.pages, R"(, "ops": )", opt.ops, R"(, "seed": )",
                   opt.seed, R"(, "shared_uuid": ")",
                   JsonEscaped(opt.shared_uuid), R"(", "guests": [)");
  for (size_t i = 0; i < runs.size(); ++i) {
    const GuestRun& g = runs[i];
    absl::StrAppend(
        &out, i == 0 ? "" : ", ", R"({"socket": ")", JsonEscaped(g.socket),
        R"(", "ok": )", g.status.ok() ? "true" : "false", R"(, "error": ")",
        JsonEscaped(std::string(g.status.message())),
        R"(", "mismatch_report": ")", JsonEscaped(g.result.mismatch_report),
        R"(", )", JsonRun(g.result, g.counters, g.result.seconds), "}");
  }
  absl::StrAppend(&out, R"(], "total": {"wall_seconds": )", wall, ", ",
                  JsonRun(total, total_c, wall), "}}\n");
  std::fputs(out.c_str(), stdout);
}

void PrintText(const Options& opt, const std::vector<GuestRun>& runs,
               const WorkloadResult& total, const GuestCounters& total_c,
               double wall) {
  std::printf("tmem-guestsim: workload %s, %zu guest(s), %" PRIu64
              " pages, %" PRIu64 " ops, seed %" PRIu64 "%s%s, %.3f s\n",
              opt.workload.c_str(), runs.size(), opt.pages, opt.ops, opt.seed,
              opt.shared_uuid.empty() ? "" : ", shared pool ",
              opt.shared_uuid.c_str(), wall);
  for (size_t i = 0; i < runs.size(); ++i) {
    std::printf("  guest %zu: %s%s%s\n", i, runs[i].socket.c_str(),
                runs[i].status.ok() ? "" : "  FAILED: ",
                runs[i].status.ok()
                    ? ""
                    : std::string(runs[i].status.message()).c_str());
  }
  std::printf("%-30s", "");
  for (size_t i = 0; i < runs.size(); ++i)
    std::printf(" %14s", absl::StrCat("guest ", i).c_str());
  std::printf(" %14s\n", "total");
  auto row = [&](const char* name, auto value_of) {
    std::printf("%-30s", name);
    for (const GuestRun& g : runs)
      std::printf(" %14s",
                  value_of(g.result, g.counters, g.result.seconds).c_str());
    std::printf(" %14s\n", value_of(total, total_c, wall).c_str());
  };
  using R = const WorkloadResult&;
  using C = const GuestCounters&;
  row("ops", [](R r, C, double) { return absl::StrCat(r.ops); });
  row("seconds",
      [](R, C, double s) { return absl::StrCat(absl::SixDigits(s)); });
  row("ops/s", [](R r, C, double s) {
    return absl::StrCat(
        static_cast<uint64_t>(Rate(static_cast<double>(r.ops), s)));
  });
  row("put MB/s (sent)", [](R, C c, double s) {
    return absl::StrCat(absl::SixDigits(
        Rate(static_cast<double>(c.puts_sent) * TMEM_PAGE_SIZE / 1e6, s)));
  });
  row("hit rate %", [](R r, C, double) {
    return absl::StrCat(
        absl::SixDigits(r.gets == 0 ? 0.0
                                    : 100.0 * static_cast<double>(r.hits) /
                                          static_cast<double>(r.gets)));
  });
  row("verified hits",
      [](R r, C, double) { return absl::StrCat(r.verified_hits); });
  row("mismatches", [](R r, C, double) { return absl::StrCat(r.mismatches); });
  const auto names = CounterList(total_c);
  for (size_t i = 0; i < names.size(); ++i) {
    row(std::string(names[i].first).c_str(),
        [i](R, C c, double) { return absl::StrCat(CounterList(c)[i].second); });
  }
}

int Main(int argc, char** argv) {
  Options opt;
  CLI::App app{
      "tmem-guestsim: plays guests against tmemd over its ivshmem sockets "
      "(one socket = one VM = one guest thread)"};
  app.add_option("--socket", opt.sockets,
                 "a VM's ivshmem socket; repeat for more guests")
      ->required();
  app.add_option("--guests", opt.guests,
                 "number of guests; must equal the number of --socket "
                 "(default: that number)")
      ->check(CLI::PositiveNumber);
  app.add_option("--workload", opt.workload, "seq|reread|random|coherency")
      ->check(CLI::IsMember({"seq", "reread", "random", "coherency"}));
  app.add_option("--pages", opt.pages, "distinct pages (keys) per guest");
  app.add_option("--ops", opt.ops,
                 "operations per guest (reread, random, coherency)");
  app.add_option("--seed", opt.seed, "random seed (guest i uses seed and i)");
  app.add_option("--shared-uuid", opt.shared_uuid,
                 "use a shared pool with this UUID (32 hex digits, dashes "
                 "allowed) instead of a private one");
  app.add_option("--report", opt.report, "final report format: text|json")
      ->check(CLI::IsMember({"text", "json"}));
  app.add_option("--vectors", opt.vectors,
                 "ivshmem vectors (as QEMU's vectors=)")
      ->check(CLI::Range(1, IvshmemClient::kMaxVectors));
  app.add_option("--connect-timeout-ms", opt.connect_timeout_ms,
                 "for connecting, the handshake and attaching")
      ->check(CLI::PositiveNumber);
  app.add_option("--get-timeout-us", opt.get_timeout_us,
                 "a get that waits longer is a miss")
      ->check(CLI::PositiveNumber);
  app.add_option("--progress-ms", opt.progress_ms,
                 "progress line on stderr every this many ms (0: none)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--stop-on-signal", opt.stop_on_signal,
               "SIGTERM (or SIGINT) ends the workload early; then report and "
               "exit");
  app.add_flag("--hold", opt.hold,
               "after the workload stay attached, pages kept, until SIGTERM "
               "(or SIGINT); then report and exit");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  if (opt.hold && opt.stop_on_signal) {
    std::fprintf(stderr,
                 "tmem-guestsim: --hold and --stop-on-signal both want "
                 "SIGTERM; pick one\n");
    return 2;
  }
  if (opt.hold || opt.stop_on_signal) {
    struct sigaction sa {};
    sa.sa_handler = OnReleaseSignal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, nullptr);
    sigaction(SIGINT, &sa, nullptr);
  }

  if (opt.guests != 0 && opt.guests != static_cast<int>(opt.sockets.size())) {
    std::fprintf(stderr,
                 "tmem-guestsim: --guests %d but %zu --socket given: each "
                 "guest needs its own VM socket (tmemd serves one client per "
                 "socket); pass --socket once per guest\n",
                 opt.guests, opt.sockets.size());
    return 2;
  }
  std::optional<TmemGuest::Uuid> uuid;
  if (!opt.shared_uuid.empty()) {
    uuid = ParseUuid(opt.shared_uuid);
    if (!uuid.has_value()) {
      std::fprintf(stderr,
                   "tmem-guestsim: --shared-uuid \"%s\" is not 32 hex digits\n",
                   opt.shared_uuid.c_str());
      return 2;
    }
  }

  const WorkloadKind kind = *ParseWorkloadKind(opt.workload);
  std::vector<GuestRun> runs(opt.sockets.size());
  std::vector<WorkloadConfig> configs(opt.sockets.size());
  uint64_t expected = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    runs[i].socket = opt.sockets[i];
    configs[i].kind = kind;
    configs[i].pages = opt.pages;
    configs[i].ops = opt.ops;
    configs[i].seed = opt.seed;
    configs[i].guest_index = static_cast<uint32_t>(i);
    configs[i].shared_uuid = uuid;
    expected += ExpectedOps(configs[i]);
  }

  std::atomic<uint64_t> progress{0};
  std::atomic<bool> finished{false};
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  threads.reserve(runs.size());
  for (size_t i = 0; i < runs.size(); ++i) {
    threads.emplace_back(RunGuest, std::cref(opt), std::cref(configs[i]),
                         &runs[i], &progress);
  }
  std::thread reporter;
  if (opt.progress_ms > 0) {
    reporter = std::thread([&] {
      uint64_t last = 0;
      auto last_time = std::chrono::steady_clock::now();
      while (!finished.load()) {
        // Sleep in small steps so a short run ends promptly.
        for (int waited = 0; waited < opt.progress_ms && !finished.load();
             waited += 10) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
        if (finished.load()) break;
        const uint64_t now_ops = progress.load();
        const auto now = std::chrono::steady_clock::now();
        const double dt =
            std::chrono::duration<double>(now - last_time).count();
        std::fprintf(stderr,
                     "tmem-guestsim: %" PRIu64 "/%" PRIu64
                     " ops (%.1f%%), %.0f ops/s\n",
                     now_ops, expected,
                     expected == 0 ? 100.0
                                   : 100.0 * static_cast<double>(now_ops) /
                                         static_cast<double>(expected),
                     Rate(static_cast<double>(now_ops - last), dt));
        last = now_ops;
        last_time = now;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  finished.store(true);
  if (reporter.joinable()) reporter.join();
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();

  WorkloadResult total;
  GuestCounters total_c;
  bool setup_failed = false;
  for (const GuestRun& g : runs) {
    if (!g.status.ok()) {
      setup_failed = true;
      std::fprintf(stderr, "tmem-guestsim: guest on %s: %s\n", g.socket.c_str(),
                   g.status.ToString().c_str());
    }
    total.ops += g.result.ops;
    total.puts += g.result.puts;
    total.gets += g.result.gets;
    total.hits += g.result.hits;
    total.invalidates += g.result.invalidates;
    total.verified_hits += g.result.verified_hits;
    total.mismatches += g.result.mismatches;
    AddCounters(&total_c, g.counters);
  }
  if (opt.report == "json") {
    PrintJson(opt, runs, total, total_c, wall);
  } else {
    PrintText(opt, runs, total, total_c, wall);
  }
  if (total.mismatches > 0) {
    std::fprintf(stderr,
                 "tmem-guestsim: COHERENCY FAILURE: %" PRIu64
                 " hit(s) returned a page other than the latest put:\n",
                 total.mismatches);
    for (const GuestRun& g : runs) {
      std::fputs(g.result.mismatch_report.c_str(), stderr);
    }
    return 1;
  }
  return setup_failed ? 2 : 0;
}

}  // namespace
}  // namespace tmem

int main(int argc, char** argv) {
  try {
    return tmem::Main(argc, argv);
  } catch (const std::exception& e) {  // e.g. no thread could be started
    std::fprintf(stderr, "tmem-guestsim: %s\n", e.what());
    return 2;
  }
}
