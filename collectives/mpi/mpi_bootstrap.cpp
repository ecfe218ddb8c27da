#include "collectives/mpi/mpi_bootstrap.h"

#include <fmt/format.h>

#include <cstdint>
#include <future>
#include <memory>

#include "collectives/mpi/mpi_runtime.h"
#include "core/error.h"

namespace mtrain {

std::string mpi_broadcast_from_rank0(const std::string& value, const std::string& what, Millis timeout) {
  mpi::MpiRuntime& runtime = mpi::MpiRuntime::instance();
  const bool root = runtime.world_rank() == 0;
  if (root && value.size() > (1u << 20)) {
    throw InvalidArgument(fmt::format("MPI bootstrap of {}: {} bytes is too large (at most 1 MiB)", what, value.size()));
  }
  auto payload = std::make_shared<std::string>(root ? value : std::string());
  auto done = std::make_shared<std::promise<void>>();
  auto task = std::make_shared<mpi::MpiTask>();
  task->description = fmt::format("MPI_Bcast of {} from rank 0", what);
  task->timeout = timeout;
  task->body = [payload] {
    // The length first, so receivers can size their buffer.
    int64_t length = static_cast<int64_t>(payload->size());
    MTRAIN_MPI_CHECK(MPI_Bcast(&length, 1, MPI_INT64_T, 0, MPI_COMM_WORLD));
    payload->resize(static_cast<size_t>(length));
    MTRAIN_MPI_CHECK(MPI_Bcast(payload->data(), static_cast<int>(length), MPI_CHAR, 0, MPI_COMM_WORLD));
  };
  task->finish = [done](std::exception_ptr error) {
    if (error) {
      done->set_exception(std::move(error));
    } else {
      done->set_value();
    }
  };
  std::future<void> finished = done->get_future();
  runtime.submit(std::move(task));
  finished.get();
  return *payload;
}

int mpi_world_rank() { return mpi::MpiRuntime::instance().world_rank(); }
int mpi_world_size() { return mpi::MpiRuntime::instance().world_size(); }

}  // namespace mtrain
