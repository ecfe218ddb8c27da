// Where a distributed worker finds its rendezvous store, whoever started it.
//
// Note [Who hosts the store]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under mtrain-launch the agent hosts the store and every worker is a client
// (StoreMode::kLauncher; MTRAIN_STORE_TOKEN and MTRAIN_STORE_PREFIX come from the agent).
// torchrun's agent store speaks PyTorch's protocol, so workers under it are refused
// (environment.cpp). Every other starter leaves the store to the workers, as torch's
// env:// does: rank 0 hosts it and the others connect.
//   - kRank0: the address is known to every rank in advance: MASTER_ADDR/MASTER_PORT
//     when set, else under SLURM the first host of SLURM_JOB_NODELIST and a port
//     derived from SLURM_JOB_ID (environment.h). Rank 0 listens on every IPv4
//     interface, or every IPv6 one for an IPv6 literal (store_bootstrap.cpp says why),
//     and checks that it reaches itself there, so the address must be one of rank 0's
//     own (a name that resolves to IPv6 only is not supported: give the literal). The token is
//     MTRAIN_STORE_TOKEN when set; otherwise one
//     derived from what every rank sees (the job id and the address), which keeps stray
//     clients of other jobs out but is no secret: the batch templates export a random
//     MTRAIN_STORE_TOKEN.
//   - kMpiBroadcast: under mpirun without MASTER_ADDR, rank 0 binds
//     a free port on its own host and broadcasts host, port and a random token over
//     MPI_COMM_WORLD, so no address has to be configured at all.
//   - kNone: a world of one, or the MPI backend under an MPI starter, which needs no
//     store (MPI bootstraps itself).
#pragma once

#include <memory>
#include <string>

#include "collectives/bootstrap.h"
#include "collectives/store.h"
#include "trainer/setup/environment.h"

namespace mtrain {

// Connects this worker to its store (see Note [Who hosts the store]); on rank 0 in the
// modes that need it, first starts the server, which lives as long as the returned
// store. A null store for StoreMode::kNone. Throws InvalidArgument for a configuration that
// cannot work (e.g. rank 0 asked to bind an address that is not its own) and CommError
// when the store cannot be reached within `timeout`.
StoreConnection open_worker_store(const WorkerEnvironment& env, Millis timeout = kDefaultStoreTimeout);

}  // namespace mtrain
