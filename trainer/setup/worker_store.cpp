#include "trainer/setup/worker_store.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <random>
#include <sstream>

#include "collectives/bootstrap.h"
#include "core/error.h"
#ifdef MTRAIN_HAVE_MPI
#include "collectives/mpi/mpi_bootstrap.h"
#endif

// Note [Who hosts the store]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under mtrain-launch the agent hosts the store and every worker is a client (StoreMode::kLauncher;
// MTRAIN_STORE_TOKEN and MTRAIN_STORE_PREFIX come from the agent). torchrun's agent store speaks
// PyTorch's protocol, so workers under it are refused (environment.cpp). Every other starter
// leaves the store to the workers, as torch's env:// does: rank 0 hosts it and the others connect.
//   - kRank0: the address is known to every rank in advance: MASTER_ADDR/MASTER_PORT when set,
//     else under SLURM the first host of SLURM_JOB_NODELIST and a port derived from SLURM_JOB_ID
//     (environment.cpp). Rank 0 listens on every IPv4 interface, or every IPv6 one for an IPv6
//     literal (any_address_like says why), and checks that it reaches itself there, so the
//     address must be one of rank 0's own (a name that resolves to IPv6 only is not supported:
//     give the literal). The token is MTRAIN_STORE_TOKEN when set; otherwise one derived from
//     what every rank sees (the job id and the address), which keeps stray clients of other jobs
//     out but is no secret: the batch templates export a random MTRAIN_STORE_TOKEN.
//   - kMpiBroadcast: under mpirun without MASTER_ADDR, rank 0 binds a free port on its own host
//     and broadcasts host, port and a random token over MPI_COMM_WORLD, so no address has to be
//     configured at all.
//   - kNone: a world of one, or the MPI backend under an MPI starter, which needs no store (MPI
//     bootstraps itself).

namespace mtrain {
namespace {

// Rank 0's server binds every interface of MASTER_ADDR's family: MASTER_ADDR (or the
// node list's first name) is how the OTHER ranks reach it, and on a typical node the
// host's own name resolves locally to a loopback alias (Debian's 127.0.1.1) that no other
// node could reach. An IPv6 literal (which has a ':') gets every IPv6 interface, anything
// else every IPv4 one. The token keeps strangers out.
const char* any_address_like(const std::string& master_addr) {
  return master_addr.find(':') != std::string::npos ? "::" : "0.0.0.0";
}

std::string this_host() {
  char name[HOST_NAME_MAX + 1] = {};
  if (::gethostname(name, sizeof name) != 0 || name[0] == '\0') return "localhost";
  return name;
}

std::string random_token() {
  std::random_device entropy;
  std::string token;
  for (int i = 0; i < 4; ++i) token += fmt::format("{:08x}", entropy());
  return token;
}

// A store handle that also keeps rank 0's server alive.
std::shared_ptr<Store> hold_server(std::shared_ptr<TcpStore> client, std::shared_ptr<TcpStoreServer> server) {
  Store* raw = client.get();
  return std::shared_ptr<Store>(raw, [client, server](Store*) {});
}

std::shared_ptr<TcpStoreServer> start_server(const char* bind_address, uint16_t port, const std::string& token,
                                             const std::string& why) {
  try {
    return std::make_shared<TcpStoreServer>(bind_address, port, token);
  } catch (const CommError& e) {
    throw CommError(fmt::format("rank 0 cannot host the rendezvous store on port {} ({}): {}{}", port, why,
                                e.what(), port != 0 ? "; set MASTER_PORT to a free port" : ""));
  }
}

std::shared_ptr<TcpStore> connect(const std::string& host, uint16_t port, const std::string& token, Millis timeout,
                               bool hosting) {
  // Rank 0 reaches its own server at once unless the address is not its own, which
  // should fail in seconds, not after the store timeout.
  const Millis connect_timeout = hosting ? std::min(timeout, Millis(20'000)) : timeout;
  try {
    return std::make_shared<TcpStore>(host, port, token, timeout, connect_timeout);
  } catch (const CommError& e) {
    if (!hosting) throw;
    throw CommError(fmt::format(
        "rank 0 hosts the rendezvous store on port {} of this host ({}) but cannot reach it as {}:{}: {}. "
        "MASTER_ADDR must name rank 0's own host",
        port, this_host(), host, port, e.what()));
  }
}

StoreConnection open_rank0_store(const WorkerEnvironment& env, Millis timeout) {
  const auto port = static_cast<uint16_t>(env.master_port);
  std::shared_ptr<TcpStoreServer> server;
  if (env.rank == 0) {
    server = start_server(any_address_like(env.master_addr), port, env.store_token,
                          fmt::format("MASTER_ADDR={}", env.master_addr));
    spdlog::info("rendezvous store: hosted by rank 0 on port {}, reached as {}:{}", port, env.master_addr, port);
    if (env.store_token_derived) {
      spdlog::warn(
          "MTRAIN_STORE_TOKEN is not set: the store admits any client that knows the job id and its address; "
          "export the same random MTRAIN_STORE_TOKEN to every rank (the templates in scripts/slurm do)");
    }
  }
  auto client = connect(env.master_addr, port, env.store_token, timeout, server != nullptr);
  return {server ? hold_server(client, server) : client, env.master_addr, port};
}

#ifdef MTRAIN_HAVE_MPI
StoreConnection open_mpi_broadcast_store(const WorkerEnvironment& env, Millis timeout) {
  if (mpi_world_rank() != env.rank || mpi_world_size() != env.world_size) {
    throw InternalError(fmt::format("MPI_COMM_WORLD says rank {} of {}, the environment rank {} of {}",
                                    mpi_world_rank(), mpi_world_size(), env.rank, env.world_size));
  }
  std::shared_ptr<TcpStoreServer> server;
  std::string announcement;
  if (env.rank == 0) {
    const std::string fresh_token = random_token();
    server = start_server("0.0.0.0", 0, fresh_token, "a free port chosen for the MPI bootstrap");
    announcement = fmt::format("{}\n{}\n{}", this_host(), server->port(), fresh_token);
  }
  announcement = mpi_broadcast_from_rank0(announcement, "the rendezvous store address", timeout);
  std::istringstream in(announcement);
  std::string host, port_text, token;
  if (!std::getline(in, host) || !std::getline(in, port_text) || !std::getline(in, token)) {
    throw InternalError(fmt::format("MPI bootstrap: malformed store announcement '{}'", announcement));
  }
  const auto port = static_cast<uint16_t>(std::stoi(port_text));
  if (server) spdlog::info("rendezvous store: hosted by rank 0 at {}:{}, announced over MPI", host, port);
  auto client = connect(host, port, token, timeout, server != nullptr);
  return {server ? hold_server(client, server) : client, host, port};
}
#endif

}  // namespace

StoreConnection open_worker_store(const WorkerEnvironment& env, Millis timeout) {
  switch (env.store_mode) {
    case StoreMode::kNone:
      return {};
    case StoreMode::kLauncher:
      return connect_store_from_env(timeout);
    case StoreMode::kRank0:
      return open_rank0_store(env, timeout);
    case StoreMode::kMpiBroadcast:
#ifdef MTRAIN_HAVE_MPI
      return open_mpi_broadcast_store(env, timeout);
#else
      throw InvalidArgument(
          "under mpirun without MASTER_ADDR the store address travels over MPI, but this build has no MPI: "
          "set MASTER_ADDR and MASTER_PORT to rank 0's host and a free port");
#endif
  }
  throw InternalError("unknown store mode");
}

}  // namespace mtrain
