// Environment discovery (trainer/environment.h): source precedence and the errors for
// contradictory variables, through a lookup over a map so no test touches the real
// process environment.
#include <catch2/catch.hpp>
#include <map>
#include <string>

#include "core/error.h"
#include "trainer/environment.h"

using Catch::Matchers::Contains;
using mtrain::InvalidArgument;
using mtrain::WorkerEnvironment;

namespace {

using Vars = std::map<std::string, std::string>;

WorkerEnvironment discover(const Vars& vars, const std::string& backend = "auto") {
  return mtrain::discover_environment(
      [&](const char* name) -> std::optional<std::string> {
        auto it = vars.find(name);
        if (it == vars.end()) return std::nullopt;
        return it->second;
      },
      backend);
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
  CHECK_THROWS_WITH(discover(slurm), Contains("MASTER_PORT is not set"));
}

TEST_CASE("first host of a SLURM node list", "[environment]") {
  CHECK(mtrain::first_slurm_host("vm") == "vm");
  CHECK(mtrain::first_slurm_host("a1,b2") == "a1");
  CHECK(mtrain::first_slurm_host("node[03-05,9],gpu1") == "node03");
  CHECK(mtrain::first_slurm_host("rack[2,4]-n[1-8]") == "rack2-n1");
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

TEST_CASE("mpirun with an MPI backend needs no MASTER_ADDR", "[environment]") {
  const Vars ompi = {{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}};
  CHECK(discover(ompi, "mpi").world_size == 2);
  CHECK(discover(ompi, "auto").world_size == 2);
  CHECK_THROWS_WITH(discover(ompi, "gloo"), Contains("MASTER_ADDR is not set"));
}
