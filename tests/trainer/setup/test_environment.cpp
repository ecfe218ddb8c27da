// Environment discovery (trainer/setup/environment.h): source precedence and the errors for
// contradictory variables, through a lookup over a map so no test touches the real
// process environment.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "collectives/process_group.h"
#include "core/error.h"
#include "tests/store/store_test_util.h"
#include "store/store.h"
#include "tensor/tensor.h"
#include "trainer/setup/environment.h"
#include "trainer/setup/worker_store.h"
#include "trainer/ddp/training_groups.h"
#include "trainer/setup/hostlist.h"

using Catch::Matchers::Contains;
using mtrain::InvalidArgument;
using mtrain::StoreMode;
using mtrain::WorkerEnvironment;

namespace {

using Vars = std::map<std::string, std::string>;

// The worker's environment and its store for `backend` ("auto" resolved for a CPU rank, as
// the run plan resolves it).
WorkerEnvironment discover(const Vars& vars, const std::string& backend = "auto") {
  const mtrain::EnvLookup lookup = [&](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
  WorkerEnvironment w = mtrain::discover_environment(lookup);
  mtrain::locate_store(lookup, mtrain::backend_info(mtrain::resolve_backend(backend, false, w.mpi_launched)), w);
  return w;
}

const Vars kLauncher = {{"RANK", "3"},        {"WORLD_SIZE", "4"},        {"LOCAL_RANK", "1"},
                        {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", "1"},   {"MASTER_ADDR", "10.0.0.1"},
                        {"MASTER_PORT", "29500"}};

Vars with(Vars base, const Vars& extra) {
  for (const auto& [k, v] : extra) base[k] = v;
  return base;
}

Vars without(Vars base, const std::string& key) {
  base.erase(key);
  return base;
}

}  // namespace

TEST_CASE("no variables is a world of one", "[environment]") {
  const auto w = discover({});
  CHECK(w.rank == 0);
  CHECK(w.world_size == 1);
  CHECK(w.local_rank == 0);
  CHECK(w.local_world_size == 1);
  CHECK(w.source == "none");
  CHECK_FALSE(w.distributed());
  CHECK(w.master_addr.empty());
}

TEST_CASE("launcher variables are read in full", "[environment]") {
  const auto w = discover(kLauncher);
  CHECK(w.source == "launcher");
  CHECK(w.rank == 3);
  CHECK(w.world_size == 4);
  CHECK(w.local_rank == 1);
  CHECK(w.local_world_size == 2);
  CHECK(w.node_rank == 1);
  CHECK(w.master_addr == "10.0.0.1");
  CHECK(w.master_port == 29500);
}

TEST_CASE("first source wins: launcher, then Open MPI, then PMIx, then SLURM", "[environment]") {
  const Vars ompi = {{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                     {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
  const Vars pmix = {{"PMIX_RANK", "1"}};
  const Vars slurm = {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "6"}, {"SLURM_LOCALID", "0"},
                      {"SLURM_NTASKS_PER_NODE", "3(x2)"}, {"SLURM_JOB_NODELIST", "node[07-09],gpu1"}};
  const Vars master = {{"MASTER_ADDR", "m"}, {"MASTER_PORT", "1234"}};

  // Same values under both names are fine; the launcher's are used.
  auto w = discover(with(with(kLauncher, ompi), {{"RANK", "2"}}));
  CHECK(w.source == "launcher");
  CHECK(w.rank == 2);

  // Under mpirun inside a SLURM allocation every rank sees SLURM_PROCID=0: OMPI wins.
  w = discover(with(with(with(ompi, pmix), slurm), master));
  CHECK(w.source == "Open MPI");
  CHECK(w.rank == 2);
  CHECK(w.world_size == 4);
  CHECK(w.local_world_size == 2);
  CHECK(w.under_mpirun);

  w = discover(with(with(pmix, slurm), master));
  CHECK(w.source == "PMIx");
  CHECK(w.rank == 1);
  CHECK(w.world_size == 6);
  CHECK(w.local_world_size == 3);

  w = discover(with(slurm, {{"MASTER_PORT", "29500"}}));
  CHECK(w.source == "SLURM");
  CHECK(w.rank == 0);
  CHECK(w.world_size == 6);
  CHECK(w.local_world_size == 3);
  CHECK(w.master_addr == "node07");  // first host of the node list
  CHECK(w.master_port == 29500);
  // Without MASTER_PORT the job id fixes the port; without a job id nothing does.
  w = discover(with(slurm, {{"SLURM_JOB_ID", "123456"}}));
  CHECK(w.master_port == 10000 + 123456 % 20000);
  CHECK(w.job_id == "123456");
  CHECK(discover(with(slurm, {{"SLURM_JOB_ID", "7"}})).master_port == 10007);
  CHECK_THROWS_WITH(discover(slurm), Contains("MASTER_PORT is not set"));
  CHECK_THROWS_WITH(discover(with(slurm, {{"SLURM_JOB_ID", "x1"}})), Contains("SLURM_JOB_ID"));
  CHECK_THROWS_WITH(discover(with(slurm, {{"SLURM_JOB_NODELIST", "node[07"}})), Contains("node[07"));
}

TEST_CASE("who hosts the store, for every starter", "[environment]") {
  // mtrain-launch (MTRAIN_RUN_ID) hosts it; the same variables set by hand mean rank 0 does.
  auto w = discover(with(kLauncher, {{"MTRAIN_RUN_ID", "r1"}, {"MTRAIN_STORE_PREFIX", "attempt0/"}}));
  CHECK(w.store_mode == StoreMode::kLauncher);
  CHECK(w.store_prefix == "attempt0/");
  w = discover(kLauncher);
  CHECK(w.store_mode == StoreMode::kRank0);
  // No shared secret: no token at all, never one an outsider could compute.
  CHECK(w.store_token.empty());
  w = discover(with(kLauncher, {{"MTRAIN_STORE_TOKEN", "s3cret"}}));
  CHECK(w.store_token == "s3cret");

  // mpirun: the MPI backend needs no store; Gloo gets one from MASTER_ADDR or through MPI.
  const Vars ompi = {{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}};
  CHECK(discover(ompi, "mpi").store_mode == StoreMode::kNone);
  CHECK(discover(ompi, "auto").store_mode == StoreMode::kNone);
  CHECK(discover(ompi, "gloo").store_mode == StoreMode::kMpiBroadcast);
  CHECK(discover(ompi, "gloo").master_addr.empty());
  w = discover(with(ompi, {{"MASTER_ADDR", "h0"}, {"MASTER_PORT", "4000"}}), "gloo");
  CHECK(w.store_mode == StoreMode::kRank0);
  CHECK(w.master_addr == "h0");
  CHECK_THROWS_WITH(discover(with(ompi, {{"MASTER_ADDR", "h0"}}), "gloo"), Contains("MASTER_PORT is not set"));

  // srun --mpi=pmix: MPI works (auto = mpi, no store); Gloo's rank 0 hosts on the first node.
  const Vars pmix = {{"PMIX_RANK", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_ID", "42"},
                     {"SLURM_JOB_NODELIST", "gpu-a[1-2]"}};
  CHECK(discover(pmix).store_mode == StoreMode::kNone);
  CHECK(discover(pmix).mpi_launched);
  w = discover(pmix, "gloo");
  CHECK(w.store_mode == StoreMode::kRank0);
  CHECK(w.master_addr == "gpu-a1");
  CHECK(w.master_port == 10042);
  CHECK(w.store_token.empty());

  // Plain srun: rank 0 hosts; the MPI backend cannot start without an MPI starter's help.
  const Vars slurm = {{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_ID", "9"},
                      {"SLURM_JOB_NODELIST", "vm"}, {"MTRAIN_STORE_TOKEN", "t"}};
  w = discover(slurm);
  CHECK(w.store_mode == StoreMode::kRank0);
  CHECK(w.master_addr == "vm");
  CHECK(w.store_token == "t");
  CHECK_FALSE(w.mpi_launched);

  CHECK(discover({}).store_mode == StoreMode::kNone);
}

TEST_CASE("SLURM host lists expand as scontrol show hostnames does", "[hostlist]") {
  using mtrain::expand_hostlist;
  using V = std::vector<std::string>;
  CHECK(expand_hostlist("vm") == V{"vm"});
  CHECK(expand_hostlist("a1,b2") == V{"a1", "b2"});
  CHECK(expand_hostlist("node[03-05,9],gpu1") == V{"node03", "node04", "node05", "node9", "gpu1"});
  CHECK(expand_hostlist("node[01-04,07],gpu-a[1-2]") ==
        V{"node01", "node02", "node03", "node04", "node07", "gpu-a1", "gpu-a2"});
  CHECK(expand_hostlist("n[8-11]") == V{"n8", "n9", "n10", "n11"});        // width of "8"
  CHECK(expand_hostlist("n[08-10]") == V{"n08", "n09", "n10"});            // width of "08"
  CHECK(expand_hostlist("n[098-100]") == V{"n098", "n099", "n100"});
  CHECK(expand_hostlist("rack[2,4]-n[1-2]") == V{"rack2-n1", "rack2-n2", "rack4-n1", "rack4-n2"});
  CHECK(expand_hostlist("[1-2]x") == V{"1x", "2x"});
  CHECK(expand_hostlist("n[5]") == V{"n5"});
  CHECK(expand_hostlist("a,a") == V{"a", "a"});
  CHECK(expand_hostlist("n[0-99999]").size() == 100000);

  CHECK_THROWS_WITH(expand_hostlist(""), Contains("host list is empty"));
  CHECK_THROWS_WITH(expand_hostlist("a,,b"), Contains("empty host name"));
  CHECK_THROWS_WITH(expand_hostlist("a,"), Contains("empty host name"));
  CHECK_THROWS_WITH(expand_hostlist("n[1-3"), Contains("never closed"));
  CHECK_THROWS_WITH(expand_hostlist("n1-3]"), Contains("closes nothing"));
  CHECK_THROWS_WITH(expand_hostlist("n[1[2]]"), Contains("nested"));
  CHECK_THROWS_WITH(expand_hostlist("n[]"), Contains("found nothing"));
  CHECK_THROWS_WITH(expand_hostlist("n[1,]"), Contains("found nothing"));
  CHECK_THROWS_WITH(expand_hostlist("n[5-3]"), Contains("upper bound is below"));
  CHECK_THROWS_WITH(expand_hostlist("n[a-c]"), Contains("expected digits"));
  CHECK_THROWS_WITH(expand_hostlist("n[1-2-3]"), Contains("expected digits"));
  CHECK_THROWS_WITH(expand_hostlist("n[-3]"), Contains("expected digits"));
  CHECK_THROWS_WITH(expand_hostlist("n[1234567890]"), Contains("at most 9 digits"));
  CHECK_THROWS_WITH(expand_hostlist("a[0-1023]b[0-1023]c[0-1]"), Contains("more than"));
  // Few enough hosts, but each name long: the bytes are bounded too.
  CHECK_THROWS_WITH(expand_hostlist(std::string(200, 'x') + "[0-1048575]"), Contains("MiB of host names"));
}

TEST_CASE("contradictions are errors naming the variable", "[environment]") {
  CHECK_THROWS_WITH(discover(with(kLauncher, {{"RANK", "4"}})),
                    Contains("RANK=4 must be smaller than WORLD_SIZE=4"));
  CHECK_THROWS_WITH(discover(without(kLauncher, "WORLD_SIZE")), Contains("WORLD_SIZE is not set"));
  CHECK_THROWS_WITH(discover(without(kLauncher, "RANK")), Contains("RANK is not set"));
  CHECK_THROWS_WITH(discover(with(kLauncher, {{"LOCAL_RANK", "2"}})),
                    Contains("LOCAL_RANK=2 must be smaller than LOCAL_WORLD_SIZE=2"));
  CHECK_THROWS_WITH(discover(with(kLauncher, {{"WORLD_SIZE", "zero"}})), Contains("WORLD_SIZE"));
  CHECK_THROWS_WITH(discover(with(kLauncher, {{"WORLD_SIZE", "0"}})), Contains("WORLD_SIZE"));
  CHECK_THROWS_WITH(discover(without(kLauncher, "MASTER_ADDR")), Contains("MASTER_ADDR is not set"));
  CHECK_THROWS_WITH(discover(without(kLauncher, "MASTER_PORT")), Contains("MASTER_PORT is not set"));
  // WORLD_SIZE inconsistent with the launcher (mpirun) that started the process.
  CHECK_THROWS_WITH(discover(with(kLauncher, {{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "3"}})),
                    Contains("WORLD_SIZE=4 contradicts OMPI_COMM_WORLD_SIZE=2"));
  CHECK_THROWS_WITH(discover({{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "4"}}, "mpi"),
                    Contains("OMPI_COMM_WORLD_RANK=5"));
  CHECK_THROWS_WITH(discover({{"PMIX_RANK", "0"}}), Contains("PMIX_RANK"));
  CHECK_THROWS_WITH(discover({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "2"}}), Contains("SLURM_PROCID=3"));
  CHECK_THROWS_AS(discover({{"SLURM_PROCID", "1"}}), InvalidArgument);
  // A world of one needs no store.
  CHECK_NOTHROW(discover({{"RANK", "0"}, {"WORLD_SIZE", "1"}}));
}

TEST_CASE("layouts that cannot be, and torchrun's agent store, are named", "[environment]") {
  CHECK_THROWS_WITH(discover(with(kLauncher, {{"LOCAL_WORLD_SIZE", "8"}, {"LOCAL_RANK", "5"}})),
                    Contains("LOCAL_WORLD_SIZE=8 exceeds WORLD_SIZE=4"));
  CHECK_THROWS_WITH(discover({{"PMIX_RANK", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "node[1-"}}, "gloo"),
                    Contains("environment variable SLURM_JOB_NODELIST: host list 'node[1-'"));
  // torchrun's static rendezvous: its agent serves PyTorch's store on MASTER_PORT.
  CHECK_THROWS_WITH(discover(with(kLauncher, {{"TORCHELASTIC_RUN_ID", "none"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}})),
                    Contains("started by torchrun with its agent's store"));
  CHECK(discover(with(kLauncher, {{"TORCHELASTIC_RUN_ID", "none"}, {"TORCHELASTIC_USE_AGENT_STORE", "False"}}))
            .store_mode == StoreMode::kRank0);
}

TEST_CASE("a launcher inside an srun task: the task's PMIX_RANK is not the worker's", "[environment]") {
  // srun --mpi=pmix torchrun ...: every worker inherits the task's PMIX_RANK and
  // SLURM_NTASKS; its own RANK and WORLD_SIZE come from the launcher.
  const auto w = discover(with(kLauncher, {{"PMIX_RANK", "0"}, {"SLURM_NTASKS", "1"}}));
  CHECK(w.rank == 3);
  CHECK_FALSE(w.mpi_launched);
  CHECK(w.store_mode == StoreMode::kRank0);
  // Where they agree (a script exporting RANK beside srun's PMIx), it is an MPI process.
  const auto agreeing = discover({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"PMIX_RANK", "1"}, {"SLURM_NTASKS", "2"}}, "mpi");
  CHECK(agreeing.mpi_launched);
}

TEST_CASE("a worker of mtrain-launch ignores the MPI identity its launcher inherited", "[environment]") {
  // mpirun -npernode 1 mtrain-launch ..., or srun --mpi=pmix mtrain-launch ...: the
  // variables name the launcher's place in its MPI job, not the worker's.
  const Vars inherited = {{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "1"},
                          {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}, {"PMIX_RANK", "0"}};
  Vars vars = with(kLauncher, {{"MTRAIN_RUN_ID", "r1"}});
  vars.insert(inherited.begin(), inherited.end());
  const auto w = discover(vars);
  CHECK(w.source == "launcher");
  CHECK(w.rank == 3);
  CHECK_FALSE(w.mpi_launched);
  CHECK_FALSE(w.under_mpirun);
  CHECK(w.store_mode == StoreMode::kLauncher);
  // Without mtrain-launch's MTRAIN_RUN_ID the contradiction is still an error.
  Vars by_hand = kLauncher;
  by_hand.insert(inherited.begin(), inherited.end());
  CHECK_THROWS_WITH(discover(by_hand), Contains("contradicts OMPI_COMM_WORLD"));
}

TEST_CASE("SLURM_NTASKS_PER_NODE out of range is named", "[environment]") {
  CHECK_THROWS_WITH(discover({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_NTASKS_PER_NODE", "99999999999(x2)"}}),
                    Contains("SLURM_NTASKS_PER_NODE ('99999999999(x2)')"));
  // Not a count at all is not "absent".
  for (const std::string bad : {"abc", "", "4x", "2(x3", "2,,1", "2,", "(x2)", "2(x)", "2(x3)x"}) {
    INFO(bad);
    CHECK_THROWS_WITH(discover({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_NTASKS_PER_NODE", bad}}),
                      Contains(fmt::format("SLURM_NTASKS_PER_NODE: expected tasks per node as SLURM writes them "
                                           "(4, 2(x3) or 2(x3),1), found '{}'", bad)));
  }
  // A long value is scanned, not matched by a recursive regex (which overflowed the
  // stack near 40 kB), and shown cut.
  CHECK_THROWS_WITH(
      discover({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_NTASKS_PER_NODE", std::string(100'000, '1') + ",x"}}),
      Contains("SLURM_NTASKS_PER_NODE: expected tasks per node") && Contains("(100002 bytes in all)"));
  CHECK(discover({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"},
                  {"SLURM_NTASKS_PER_NODE", "2(x1),2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}).local_world_size == 2);
}

TEST_CASE("mpirun with an MPI backend needs no MASTER_ADDR", "[environment]") {
  const Vars ompi = {{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}};
  CHECK(discover(ompi, "mpi").world_size == 2);
  CHECK(discover(ompi, "auto").world_size == 2);
}

TEST_CASE("a rank whose backend or device differs from rank 0's fails before any group", "[unit]") {
  // Otherwise a Gloo rank would wait --timeout for peers stuck in NCCL's set-up.
  const std::string token = mtrain::generate_store_token();
  mtrain::TcpStoreServer server("127.0.0.1", 0, token);
  mtrain::TcpStore rank0("127.0.0.1", server.port(), token);
  mtrain::TcpStore rank1("127.0.0.1", server.port(), token);
  mtrain::TcpStore rank2("127.0.0.1", server.port(), token);
  mtrain::require_rank0_backend(rank0, 0, "nccl", mtrain::Device::cuda(0));
  // Another GPU index is the same kind of device.
  CHECK_NOTHROW(mtrain::require_rank0_backend(rank1, 1, "nccl", mtrain::Device::cuda(1)));
  CHECK_THROWS_WITH(mtrain::require_rank0_backend(rank2, 2, "gloo", mtrain::Device::cpu()),
                    Catch::Contains("rank 2 trains with gloo on the CPU but rank 0 with nccl on a GPU"));
}

TEST_CASE("rank 0 hosts the store for an IPv6 MASTER_ADDR too", "[environment]") {
  // It bound every IPv4 interface only, so MASTER_ADDR=::1 could not reach it.
  const int probe = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in6 loopback{};
  loopback.sin6_family = AF_INET6;
  loopback.sin6_addr = in6addr_loopback;
  const bool has_ipv6 = probe >= 0 && ::bind(probe, reinterpret_cast<sockaddr*>(&loopback), sizeof loopback) == 0;
  socklen_t length = sizeof loopback;
  const bool got_port = has_ipv6 && ::getsockname(probe, reinterpret_cast<sockaddr*>(&loopback), &length) == 0;
  const int port = got_port ? ntohs(loopback.sin6_port) : 0;
  if (probe >= 0) ::close(probe);  // a free port, released for the store
  if (!has_ipv6 || !got_port) {
    WARN("skipped: no IPv6 loopback here");
    return;
  }
  mtrain::WorkerEnvironment env;
  env.rank = 0;
  env.world_size = 2;
  env.master_addr = "::1";
  env.master_port = port;
  env.store_mode = StoreMode::kRank0;
  env.store_token = "ipv6-token";
  auto store = mtrain::open_worker_store(env, false, mtrain::Millis(5000)).store;
  store->set("k", std::string("v"));
  mtrain::TcpStore other("::1", static_cast<uint16_t>(port), "ipv6-token", mtrain::Millis(5000));
  CHECK(other.get_string("k") == "v");
}

namespace {

// The local address a listening TCP socket on `port` is bound to, read from
// /proc/net/tcp (IPv4, hex "0100007F" for 127.0.0.1); empty when none listens.
std::string listening_address(int port) {
  std::ifstream in("/proc/net/tcp");
  std::string line;
  std::getline(in, line);  // header
  const std::string wanted = fmt::format(":{:04X}", port);
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string slot, local, remote, state;
    fields >> slot >> local >> remote >> state;
    if (state == "0A" && local.size() > 5 && local.substr(local.size() - 5) == wanted) {
      return local.substr(0, local.size() - 5);
    }
  }
  return {};
}

}  // namespace

TEST_CASE("rank 0's store listens on MASTER_ADDR's address only and admits no computable token", "[environment]") {
  // Note [The store's address] and Note [Workers without a shared secret].
  const int port = mtrain::testing::unused_loopback_port();
  mtrain::WorkerEnvironment env;
  env.rank = 0;
  env.world_size = 2;
  env.master_addr = "127.0.0.1";
  env.master_port = port;
  env.store_mode = StoreMode::kRank0;
  env.job_id = "";
  auto store = mtrain::open_worker_store(env, false, mtrain::Millis(5000));
  CHECK(store.host == "127.0.0.1");
  CHECK(listening_address(port) == "0100007F");  // 127.0.0.1, not 00000000 (every interface)
  // The token the store used to derive from what anyone can see is refused.
  CHECK_THROWS_WITH(mtrain::TcpStore("127.0.0.1", static_cast<uint16_t>(port),
                                     fmt::format("mtrain-derived::127.0.0.1:{}", port), mtrain::Millis(2000),
                                     mtrain::Millis(2000)),
                    Contains("rejected the job token"));
  // Without a shared secret a client presents none (and the log says so plainly).
  mtrain::TcpStore peer("127.0.0.1", static_cast<uint16_t>(port), "", mtrain::Millis(5000));
  store.store->set("k", std::string("v"));
  CHECK(peer.get_string("k") == "v");
}

namespace {

// An IPv4 address of this host other than loopback, or "" when it has none.
std::string routable_address() {
  ifaddrs* all = nullptr;
  if (::getifaddrs(&all) != 0) return {};
  std::string found;
  for (ifaddrs* a = all; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof text);
    if (std::string(text).rfind("127.", 0) != 0) found = text;
  }
  ::freeifaddrs(all);
  return found;
}

}  // namespace

TEST_CASE("a store other hosts can reach needs a secret, or --unauthenticated-store", "[environment]") {
  // Note [Workers without a shared secret].
  const std::string address = routable_address();
  if (address.empty()) {
    WARN("skipped: this host has no address but loopback");
    return;
  }
  mtrain::WorkerEnvironment env;
  env.rank = 1;  // every rank refuses, before anything connects
  env.world_size = 2;
  env.master_addr = address;
  env.master_port = mtrain::testing::unused_loopback_port();
  env.store_mode = StoreMode::kRank0;
  CHECK_THROWS_WITH(mtrain::open_worker_store(env, false, mtrain::Millis(2000)),
                    Contains("an address other hosts can reach") && Contains("MTRAIN_STORE_TOKEN is not set") &&
                        Contains("--unauthenticated-store"));
  env.rank = 0;
  CHECK_THROWS_AS(mtrain::open_worker_store(env, false, mtrain::Millis(2000)), mtrain::InvalidArgument);
  // Accepted: rank 0 hosts it without authentication.
  auto store = mtrain::open_worker_store(env, true, mtrain::Millis(5000));
  CHECK(store.host == address);
  mtrain::TcpStore peer(address, static_cast<uint16_t>(env.master_port), "", mtrain::Millis(5000));
  store.store->set("k", std::string("v"));
  CHECK(peer.get_string("k") == "v");
  // With a token, no question.
  env.store_token = "secret";
  env.master_port = mtrain::testing::unused_loopback_port();
  auto guarded = mtrain::open_worker_store(env, false, mtrain::Millis(5000));
  CHECK_THROWS_WITH(mtrain::TcpStore(address, static_cast<uint16_t>(env.master_port), "", mtrain::Millis(2000),
                                     mtrain::Millis(2000)),
                    Contains("rejected the job token"));
}
