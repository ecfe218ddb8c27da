#include "launcher/log_streams.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace mtrain::launch {
namespace {

void write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = ::write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // a closed console or a full disk must not stop the launcher
    data += n;
    size -= static_cast<size_t>(n);
  }
}

int open_log_file(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw IoError(fmt::format("cannot open worker log {}: {}", path.string(),
                              std::strerror(errno)));
  }
  return fd;
}

}  // namespace

LogStreams::LogStreams(const LaunchOptions& options) : options_(options) {}

LogStreams::~LogStreams() {
  finish(std::chrono::milliseconds(0));
}

bool LogStreams::needs_files(const LaunchOptions& options) {
  return options.redirects.any() || options.tee.any();
}

// Note [Worker output routing]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each stream of a worker, from --redirects, --tee and --local_ranks_filter, is one of
//   console  - the launcher's own stream, inherited: nothing is copied;
//   file     - the worker writes straight into <attempt dir>/<rank>/<stream>.log;
//   tee      - a pipe; one pump thread copies every chunk to the file and every complete
//              line to the console prefixed "[rank<N>]:";
//   discard  - /dev/null (a filtered-out rank that is not redirected).
// Outside --local_ranks_filter, `tee` degrades to `file`. The pump copies bytes, so a
// worker that floods its output is slowed by the console as it would be without the
// launcher, and the main thread, which watches the workers' exits, never waits for it.

LogStreams::Route LogStreams::route_for(int local_rank, int bit) const {
  const bool shown = !options_.local_ranks_filter || options_.local_ranks_filter->count(local_rank);
  const bool tee = options_.tee.for_local_rank(local_rank) & bit;
  const bool redirect = options_.redirects.for_local_rank(local_rank) & bit;
  if (tee) return shown ? Route::kTee : Route::kFile;
  if (redirect) return Route::kFile;
  return shown ? Route::kConsole : Route::kDiscard;
}

int LogStreams::open_stream(Route route, int global_rank, int console_fd,
                            const std::filesystem::path& file) {
  switch (route) {
    case Route::kConsole:
      return -1;
    case Route::kDiscard: {
      const int fd = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
      if (fd < 0) throw IoError(fmt::format("cannot open /dev/null: {}", std::strerror(errno)));
      return fd;
    }
    case Route::kFile:
      return open_log_file(file);
    case Route::kTee: {
      int fds[2];
      if (pipe2(fds, O_CLOEXEC) != 0) {
        throw IoError(fmt::format("pipe2 for rank {}'s output: {}", global_rank,
                                  std::strerror(errno)));
      }
      TeeStream s;
      s.read_fd = fds[0];
      s.file_fd = open_log_file(file);
      s.console_fd = console_fd;
      s.prefix = fmt::format("[rank{}]:", global_rank);
      tees_.push_back(std::move(s));
      return fds[1];
    }
  }
  return -1;
}

ChildStreams LogStreams::open_for_worker(int local_rank, int global_rank,
                                         const std::filesystem::path& rank_dir) {
  ChildStreams c;
  c.stdout_fd = open_stream(route_for(local_rank, kStdoutBit), global_rank,
                            STDOUT_FILENO, rank_dir / "stdout.log");
  c.stderr_fd = open_stream(route_for(local_rank, kStderrBit), global_rank,
                            STDERR_FILENO, rank_dir / "stderr.log");
  return c;
}

void LogStreams::close_child_ends(const ChildStreams& streams) {
  // The child holds its own copies now; keeping ours would hide end-of-file from the pump.
  if (streams.stdout_fd >= 0) ::close(streams.stdout_fd);
  if (streams.stderr_fd >= 0) ::close(streams.stderr_fd);
}

void LogStreams::start() {
  if (tees_.empty() || thread_.joinable()) return;
  stop_ = false;
  pump_done_ = false;
  thread_ = std::thread([this] { pump(); });
}

void LogStreams::drain(TeeStream& s, bool at_eof) {
  // Complete lines go out with the prefix, each in one write so that lines of different
  // ranks do not interleave mid-line.
  size_t start = 0;
  std::string line;
  while (true) {
    const size_t nl = s.partial.find('\n', start);
    if (nl == std::string::npos) break;
    line.assign(s.prefix);
    line.append(s.partial, start, nl - start + 1);
    write_all(s.console_fd, line.data(), line.size());
    start = nl + 1;
  }
  s.partial.erase(0, start);
  if (at_eof && !s.partial.empty()) {
    line = s.prefix + s.partial + "\n";
    write_all(s.console_fd, line.data(), line.size());
    s.partial.clear();
  }
}

void LogStreams::pump() {
  pump_loop();
  pump_done_ = true;
}

void LogStreams::pump_loop() {
  std::vector<char> buffer(64 * 1024);
  while (!stop_) {
    std::vector<pollfd> fds;
    std::vector<size_t> index;
    for (size_t i = 0; i < tees_.size(); ++i) {
      if (tees_[i].read_fd >= 0) {
        fds.push_back({tees_[i].read_fd, POLLIN, 0});
        index.push_back(i);
      }
    }
    if (fds.empty()) break;
    const int ready = ::poll(fds.data(), fds.size(), 50);
    if (ready < 0 && errno != EINTR) break;
    for (size_t k = 0; ready > 0 && k < fds.size(); ++k) {
      if (fds[k].revents == 0) continue;
      TeeStream& s = tees_[index[k]];
      const ssize_t n = ::read(s.read_fd, buffer.data(), buffer.size());
      if (n > 0) {
        write_all(s.file_fd, buffer.data(), static_cast<size_t>(n));
        s.partial.append(buffer.data(), static_cast<size_t>(n));
        drain(s, false);
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        drain(s, true);
        ::close(s.read_fd);
        s.read_fd = -1;
      }
    }
  }
}

void LogStreams::finish(std::chrono::milliseconds timeout) {
  if (thread_.joinable()) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    // The pump exits by itself once every pipe is at end-of-file.
    while (!pump_done_ && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    stop_ = true;
    thread_.join();
  }
  for (auto& s : tees_) {
    if (s.read_fd >= 0) {
      drain(s, true);
      ::close(s.read_fd);
    }
    if (s.file_fd >= 0) ::close(s.file_fd);
  }
  tees_.clear();
}

}  // namespace mtrain::launch
