#include "trainer/setup/worker_store.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <random>
#include <sstream>

#include "collectives/bootstrap.h"
#include "store/network_address.h"
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
//     (environment.cpp). Rank 0 listens on exactly one address, the one through which its host
//     reaches MASTER_ADDR (Note [The store's address] in store/network_address.cpp), and
//     checks that it reaches itself there, so MASTER_ADDR must name rank 0's own host. The
//     token is MTRAIN_STORE_TOKEN (Note [Workers without a shared secret] when it is unset).
//   - kMpiBroadcast: under mpirun without MASTER_ADDR, rank 0 binds a free port on its own host
//     and broadcasts host, port and a random token over MPI_COMM_WORLD, so no address has to be
//     configured at all.
//   - kNone: a world of one, or the MPI backend under an MPI starter, which needs no store (MPI
//     bootstraps itself).

namespace mtrain {
namespace {

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

// `token` empty: a server without authentication (Note [Workers without a shared secret]).
std::shared_ptr<TcpStoreServer> start_server(const std::string& bind_address, uint16_t port, const std::string& token,
                                             const std::string& why) {
  try {
    if (token.empty()) {
      return std::make_shared<TcpStoreServer>(bind_address, port, TcpStoreServer::Unauthenticated{});
    }
    return std::make_shared<TcpStoreServer>(bind_address, port, token);
  } catch (const CommError& e) {
    throw CommError(fmt::format("rank 0 cannot host the rendezvous store at {} port {} ({}): {}{}", bind_address,
                                port, why, e.what(),
                                port != 0 ? "; MASTER_ADDR must name rank 0's own host and MASTER_PORT a free port"
                                          : ""));
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

// Note [Workers without a shared secret]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Workers started by hand, by SLURM or by an orchestrator with torch-style variables share
// nothing secret: the job id, the address and the port are visible to anyone on the
// cluster, so a token derived from them would only pretend to keep strangers out. So:
//   - MTRAIN_STORE_TOKEN, the same random secret exported to every rank (the templates in
//     scripts/slurm do), is what a client must present;
//   - without it, ranks that MPI started (mpirun, srun --mpi=pmix) share one: rank 0 draws
//     a random token and broadcasts it over MPI_COMM_WORLD before the store starts, as the
//     MPI bootstrap does for the address (kMpiBroadcast);
//   - otherwise a store on a loopback address (a one-node job, which no other host can
//     reach) runs without authentication, as PyTorch's TCPStore always does, and rank 0
//     says so; on any other address every rank refuses to start (each computes the same
//     address), naming how to set a token, unless --unauthenticated-store accepts the risk.
// mtrain-launch always uses a fresh token of its own.
namespace {

bool loopback(const std::string& address) { return address.rfind("127.", 0) == 0 || address == "::1"; }

}  // namespace

// The token every rank uses with a store at `address` (Note [Workers without a shared secret]).
std::string rank0_store_token(const WorkerEnvironment& env, const std::string& address, uint16_t port,
                              bool allow_unauthenticated, Millis timeout) {
  if (!env.store_token.empty()) return env.store_token;
#ifdef MTRAIN_HAVE_MPI
  if (env.mpi_launched) {
    const std::string token = mpi_broadcast_from_rank0(env.rank == 0 ? random_token() : "", "the store's secret",
                                                       timeout);
    if (env.rank == 0) spdlog::info("rendezvous store: its secret was drawn by rank 0 and shared over MPI");
    return token;
  }
#endif
  if (loopback(address)) {
    if (env.rank == 0) {
      spdlog::warn("MTRAIN_STORE_TOKEN is not set: the store admits every process of this host that connects to "
                   "{}:{} (loopback). Export the same random MTRAIN_STORE_TOKEN to every rank to require it",
                   address, port);
    }
    return "";
  }
  if (!allow_unauthenticated) {
    throw InvalidArgument(fmt::format(
        "the rendezvous store would listen on {}:{}, an address other hosts can reach, and MTRAIN_STORE_TOKEN is "
        "not set: any process that reaches it could join this job or disrupt it. Export the same secret to every "
        "rank (e.g. `export MTRAIN_STORE_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \\n')` before starting "
        "them), start them with mpirun or srun --mpi=pmix, which share one over MPI, or pass "
        "--unauthenticated-store to accept the risk",
        address, port));
  }
  if (env.rank == 0) {
    spdlog::warn("--unauthenticated-store: the store at {}:{} admits every process that can connect to it; nothing "
                 "but who can reach that address protects this job",
                 address, port);
  }
  return "";
}

StoreConnection open_rank0_store(const WorkerEnvironment& env, bool allow_unauthenticated, Millis timeout) {
  const auto port = static_cast<uint16_t>(env.master_port);
  // Every rank on rank 0's host reaches it at the address it listens on; the others at
  // MASTER_ADDR (Note [The store's address]).
  const std::string address = store_address_for(env.master_addr, port);
  const std::string token = rank0_store_token(env, address, port, allow_unauthenticated, timeout);
  std::shared_ptr<TcpStoreServer> server;
  if (env.rank == 0) {
    server = start_server(address, port, token, fmt::format("MASTER_ADDR={}", env.master_addr));
    spdlog::info("rendezvous store: hosted by rank 0 at {}:{} (MASTER_ADDR={})", address, port, env.master_addr);
  }
  auto client = connect(address, port, token, timeout, server != nullptr);
  return {server ? hold_server(client, server) : client, address, port};
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
    // This host as the others reach it (Note [The store's address]), announced as a number.
    const std::string address = store_address_for(this_host(), 1);
    const std::string fresh_token = random_token();
    server = start_server(address, 0, fresh_token, "a free port chosen for the MPI bootstrap");
    announcement = fmt::format("{}\n{}\n{}", address, server->port(), fresh_token);
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

StoreConnection open_worker_store(const WorkerEnvironment& env, bool allow_unauthenticated, Millis timeout) {
  switch (env.store_mode) {
    case StoreMode::kNone:
      return {};
    case StoreMode::kLauncher:
      return connect_store_from_env(timeout);
    case StoreMode::kRank0:
      return open_rank0_store(env, allow_unauthenticated, timeout);
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
