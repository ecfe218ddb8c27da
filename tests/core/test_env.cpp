#include <catch2/catch.hpp>

#include <cstdlib>

#include "core/env.h"
#include "core/files.h"
#include "core/error.h"

using namespace mtrain;

TEST_CASE("parse_int accepts integers in range and names the source on error") {
  CHECK(env::parse_int("42", "--x") == 42);
  CHECK(env::parse_int("-3", "--x") == -3);
  CHECK_THROWS_WITH(env::parse_int("abc", "--nproc_per_node", 1),
                    Catch::Contains("--nproc_per_node") && Catch::Contains("'abc'"));
  CHECK_THROWS_WITH(env::parse_int("12x", "--x"), Catch::Contains("expected an integer"));
  CHECK_THROWS_WITH(env::parse_int("", "--x"), Catch::Contains("expected an integer"));
  CHECK_THROWS_WITH(env::parse_int("0", "--n", 1), Catch::Contains(">= 1"));
  CHECK_THROWS_AS(env::parse_int("99999999999999999999", "--x"), InvalidArgument);
  CHECK_THROWS_WITH(env::parse_int("5", "--n", 0, 3), Catch::Contains("[0, 3]"));
}

TEST_CASE("get_int reads and validates an environment variable") {
  ::setenv("MTRAIN_TEST_INT", "7", 1);
  CHECK(env::get_int("MTRAIN_TEST_INT").value() == 7);
  ::setenv("MTRAIN_TEST_INT", "seven", 1);
  CHECK_THROWS_WITH(env::get_int("MTRAIN_TEST_INT"),
                    Catch::Contains("MTRAIN_TEST_INT") && Catch::Contains("seven"));
  ::unsetenv("MTRAIN_TEST_INT");
  CHECK_FALSE(env::get_int("MTRAIN_TEST_INT").has_value());
}

TEST_CASE("get_choice returns a listed value, the first when unset, and names the rest") {
  ::unsetenv("MTRAIN_TEST_CHOICE");
  CHECK(env::get_choice("MTRAIN_TEST_CHOICE", {"idle", "normal"}) == "idle");
  ::setenv("MTRAIN_TEST_CHOICE", "normal", 1);
  CHECK(env::get_choice("MTRAIN_TEST_CHOICE", {"idle", "normal"}) == "normal");
  ::setenv("MTRAIN_TEST_CHOICE", "realtime", 1);
  CHECK_THROWS_WITH(env::get_choice("MTRAIN_TEST_CHOICE", {"idle", "normal"}),
                    Catch::Contains("MTRAIN_TEST_CHOICE") && Catch::Contains("'realtime'") &&
                        Catch::Contains("'idle', 'normal'"));
  ::setenv("MTRAIN_TEST_CHOICE", "", 1);  // set but empty is not a choice
  CHECK_THROWS_AS(env::get_choice("MTRAIN_TEST_CHOICE", {"idle", "normal"}), InvalidArgument);
  ::unsetenv("MTRAIN_TEST_CHOICE");
}

TEST_CASE("free_bytes asks the filesystem, and names a directory it cannot ask about") {
  CHECK(free_bytes("/") > 0);
  CHECK_THROWS_WITH(free_bytes("/no/such/directory"), Catch::Contains("/no/such/directory"));
}
