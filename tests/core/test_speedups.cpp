// MTRAIN_SPEEDUPS (Note [Speed switches] in core/speedups.h): names, `all`, blanks and
// empty items, and an unknown name named with every known one.
#include <catch2/catch.hpp>

#include "core/error.h"
#include "core/speedups.h"
#include "tests/support/scoped_env.h"

using namespace mtrain;

TEST_CASE("parse_speedups turns on the switches it names") {
  const std::string source = "environment variable MTRAIN_SPEEDUPS";
  CHECK(parse_speedups("", source) == Speedups{});
  CHECK_FALSE(parse_speedups(" , ", source).any());
  Speedups bn_only;
  bn_only.fused_bn = true;
  CHECK(parse_speedups("fused-bn", source) == bn_only);
  const Speedups two = parse_speedups(" fused-bn , fresh-grads,", source);
  CHECK(two.fused_bn);
  CHECK(two.fresh_grads);
  CHECK_FALSE(two.skip_conv_bias);
  CHECK(two.str() == "fused-bn, fresh-grads");
  const Speedups all = parse_speedups("all", source);
  for (const std::string& name : speedup_names()) {
    CHECK(parse_speedups(name, source).any());
    CHECK(all.str().find(name) != std::string::npos);
  }
  CHECK(Speedups{}.str() == "none");
  CHECK_THROWS_WITH(parse_speedups("fused-bn,cuda-graphs", source),
                    Catch::Contains("MTRAIN_SPEEDUPS") && Catch::Contains("'cuda-graphs'") &&
                        Catch::Contains("fused-bn, skip-conv-bias, fresh-grads, cudnn-graph, amp-activations or all"));
}

TEST_CASE("speedups_from_environment reads MTRAIN_SPEEDUPS") {
  {
    const testing::ScopedEnv unset("MTRAIN_SPEEDUPS", std::nullopt);
    CHECK_FALSE(speedups_from_environment().any());
  }
  const testing::ScopedEnv set("MTRAIN_SPEEDUPS", "skip-conv-bias");
  CHECK(speedups_from_environment().skip_conv_bias);
}
