// Two "hosts" on one machine: two network namespaces joined by a veth pair,
// 198.51.100.1 <-> 198.51.100.2 (TEST-NET-2, never routed), each with its own loopback.
//
// Note [Namespace names and cleanup]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Names carry the test process's pid ("mtrain-mh-<pid>-a", veth "mhv<pid>a"; a veth
// name has at most 15 characters), so concurrent runs never collide; the addresses can
// repeat because each pair lives in its own namespaces. The veth pair is created with
// both ends already inside their namespaces, so deleting the two namespaces removes
// everything (the kernel destroys a veth with its namespace). The destructor does that,
// also when a check fails (Catch2 unwinds). A run killed outright (CTest's timeout)
// cannot clean up, so the constructor first deletes namespaces left by test processes
// that no longer exist.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/trainer/run_process.h"

namespace mtrain::testing {

// Namespaces cannot be made here (no `ip`, not root, no CAP_NET_ADMIN, ...): the test
// skips with this message.
class NetnsUnavailable : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// `ip` from iproute2, or "" when it is not installed.
inline std::string find_ip_tool() {
  for (const char* dir : {"/usr/sbin", "/sbin", "/usr/bin", "/bin"}) {
    const std::string path = std::string(dir) + "/ip";
    if (::access(path.c_str(), X_OK) == 0) return path;
  }
  return "";
}

class NetnsPair {
 public:
  static constexpr const char* kAddressA = "198.51.100.1";
  static constexpr const char* kAddressB = "198.51.100.2";

  NetnsPair() : ip_(find_ip_tool()) {
    if (ip_.empty()) throw NetnsUnavailable("the `ip` tool (iproute2) is not installed");
    remove_stale_namespaces();
    const std::string tag = std::to_string(::getpid());
    ns_a_ = kNamePrefix + tag + "-a";
    ns_b_ = kNamePrefix + tag + "-b";
    veth_a_ = "mhv" + tag + "a";
    veth_b_ = "mhv" + tag + "b";
    // The first step is the one that needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN for the
    // /run/netns bind mount): its failure means "cannot run here", not a bug.
    if (const auto r = run_process(ip_, {"netns", "add", ns_a_}); r.exit_code != 0) {
      throw NetnsUnavailable("cannot create a network namespace (`ip netns add` needs root or "
                             "CAP_NET_ADMIN and CAP_SYS_ADMIN): " + trimmed(r.err));
    }
    created_a_ = true;
    try {
      ip({"netns", "add", ns_b_});
      created_b_ = true;
      ip({"link", "add", veth_a_, "netns", ns_a_, "type", "veth", "peer", "name", veth_b_, "netns", ns_b_});
      ip({"-n", ns_a_, "addr", "add", std::string(kAddressA) + "/24", "dev", veth_a_});
      ip({"-n", ns_b_, "addr", "add", std::string(kAddressB) + "/24", "dev", veth_b_});
      for (const auto& ns : {ns_a_, ns_b_}) ip({"-n", ns, "link", "set", "lo", "up"});
      ip({"-n", ns_a_, "link", "set", veth_a_, "up"});
      ip({"-n", ns_b_, "link", "set", veth_b_, "up"});
    } catch (const std::exception& e) {
      remove();
      throw NetnsUnavailable(std::string("cannot join two network namespaces with a veth pair: ") + e.what());
    }
  }
  ~NetnsPair() { remove(); }
  NetnsPair(const NetnsPair&) = delete;
  NetnsPair& operator=(const NetnsPair&) = delete;

  const std::string& ns_a() const { return ns_a_; }
  const std::string& ns_b() const { return ns_b_; }
  const std::string& veth_a() const { return veth_a_; }
  const std::string& veth_b() const { return veth_b_; }

  // `program args...` inside namespace `ns`, as `ip netns exec` runs it.
  ProcessResult run_in(const std::string& ns, const std::string& program, const std::vector<std::string>& args) const {
    std::vector<std::string> argv = {"netns", "exec", ns, program};
    argv.insert(argv.end(), args.begin(), args.end());
    return run_process(ip_, argv);
  }

  // `ip args...` in the root namespace (use "-n <ns>" to address one of the pair).
  ProcessResult ip_command(const std::vector<std::string>& args) const { return run_process(ip_, args); }

  // The `ip` tool, for starting `ip netns exec` in the background.
  const std::string& ip_tool() const { return ip_; }

  // Takes namespace B's end of the link down or up: B is cut off from A (both ways), as a
  // pulled cable would, and back. Throws if `ip` fails.
  void set_link_b(bool up) const { ip({"-n", ns_b_, "link", "set", "dev", veth_b_, up ? "up" : "down"}); }

 private:
  static constexpr const char* kNamePrefix = "mtrain-mh-";

  static std::string trimmed(std::string text) {
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    return text;
  }

  void ip(const std::vector<std::string>& args) const {
    const auto r = run_process(ip_, args);
    if (r.exit_code != 0) {
      std::string command = "ip";
      for (const auto& a : args) command += " " + a;
      throw std::runtime_error(command + " failed: " + trimmed(r.err));
    }
  }

  void remove() {
    if (created_b_) run_process(ip_, {"netns", "del", ns_b_});
    if (created_a_) run_process(ip_, {"netns", "del", ns_a_});
    created_a_ = created_b_ = false;
  }

  // Note [Namespace names and cleanup]: a pid that no longer exists cannot be using
  // its namespaces any more.
  void remove_stale_namespaces() const {
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator("/run/netns", ec)) {
      const std::string name = entry.path().filename().string();
      if (name.rfind(kNamePrefix, 0) != 0) continue;
      const std::string rest = name.substr(std::char_traits<char>::length(kNamePrefix));
      const size_t dash = rest.find('-');
      if (dash == std::string::npos || dash == 0) continue;
      pid_t owner = 0;
      try {
        owner = static_cast<pid_t>(std::stol(rest.substr(0, dash)));
      } catch (const std::exception&) {
        continue;
      }
      if (::kill(owner, 0) != 0 && errno == ESRCH) run_process(ip_, {"netns", "del", name});
    }
  }

  std::string ip_;
  std::string ns_a_, ns_b_, veth_a_, veth_b_;
  bool created_a_ = false;
  bool created_b_ = false;
};

}  // namespace mtrain::testing
