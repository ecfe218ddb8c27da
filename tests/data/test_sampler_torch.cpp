// --shuffle-order torch: DistributedSampler's shards equal PyTorch's own, index for index,
// computed by real PyTorch (Debian's python3-torch at /usr/bin/python3). Skips without it.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/distributed_sampler.h"
#include "data/random.h"
#include "tests/support/skip.h"

using namespace mtrain::data;

namespace {

struct Case {
  int64_t n;
  int world;
  uint64_t seed;
  int64_t epoch;
  bool drop_last;
};

// Every case's shards, rank by rank, from torch.utils.data.DistributedSampler.
nlohmann::json torch_shards(const std::vector<Case>& cases) {
  std::string spec = "[";
  for (const Case& c : cases) {
    spec += fmt::format("({},{},{},{},{}),", c.n, c.world, c.seed, c.epoch, c.drop_last ? "True" : "False");
  }
  spec += "]";
  const std::string program =
      "import json\n"
      "from torch.utils.data import DistributedSampler\n"
      "out = []\n"
      "for n, world, seed, epoch, drop_last in " + spec + ":\n"
      "    shards = []\n"
      "    for rank in range(world):\n"
      "        s = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed,\n"
      "                               drop_last=drop_last)\n"
      "        s.set_epoch(epoch)\n"
      "        shards.append(list(s))\n"
      "    out.append(shards)\n"
      "print(json.dumps(out))\n";
  const std::string command = "/usr/bin/python3 -c '" + program + "' 2>/dev/null";
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(command.c_str(), "r"), pclose);
  REQUIRE(pipe);
  std::string text;
  char buf[65536];
  while (const size_t got = fread(buf, 1, sizeof buf, pipe.get())) text.append(buf, got);
  const int status = pclose(pipe.release());
  REQUIRE(status == 0);
  return nlohmann::json::parse(text);
}

}  // namespace

TEST_CASE("--shuffle-order torch: every rank's shard is PyTorch DistributedSampler's") {
  if (std::system("/usr/bin/python3 -c 'import torch.utils.data' >/dev/null 2>&1") != 0) {
    mtrain::testing::skip_test_binary("/usr/bin/python3 cannot import torch (apt-get install python3-torch)");
  }
  const std::vector<Case> cases = {
      {10, 1, 0, 0, false},      {10, 3, 0, 0, false},     {10, 3, 0, 0, true},  {7, 2, 42, 3, false},
      {2, 5, 1, 0, false},       {1000, 4, 7, 11, false},  {999, 8, 123, 2, true}, {60000, 2, 0, 1, false},
      {257, 3, 4294967296ull + 5, 0, false},  // a seed beyond 32 bits: PyTorch keeps its low 32
  };
  const nlohmann::json expected = torch_shards(cases);
  REQUIRE(expected.size() == cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    for (int rank = 0; rank < c.world; ++rank) {
      INFO("N " << c.n << " world " << c.world << " seed " << c.seed << " epoch " << c.epoch << " drop_last "
                << c.drop_last << " rank " << rank);
      DistributedSampler sampler(c.n, rank, c.world, true, c.seed, c.drop_last, Permutation::kTorch);
      sampler.set_epoch(c.epoch);
      CHECK(sampler.indices() == expected[i][static_cast<size_t>(rank)].get<std::vector<int64_t>>());
    }
  }
  // mtrain's own order is a different one: the option really chooses.
  DistributedSampler own(1000, 0, 4, true, 7, false);
  own.set_epoch(11);
  CHECK(own.indices() != expected[5][0].get<std::vector<int64_t>>());
}
