// OperationQueue (collectives/gloo): one task at a time in issue order, run by the
// communication thread or by a waiter whose task is next (Note [Running an operation on
// the waiting thread]).
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>
#include <vector>

#include "collectives/gloo/operation_queue.h"
#include "collectives/process_group.h"

using namespace mtrain;

namespace {

using Clock = std::chrono::steady_clock;

// Records which thread ran each task, in the order they ran.
struct Log {
  std::mutex mu;
  std::vector<std::pair<int, std::thread::id>> ran;
  void add(int id) {
    std::lock_guard<std::mutex> lock(mu);
    ran.emplace_back(id, std::this_thread::get_id());
  }
  std::vector<int> order() {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<int> ids;
    for (const auto& r : ran) ids.push_back(r.first);
    return ids;
  }
};

}  // namespace

TEST_CASE("operation queue: a waiter runs its task itself when it is next and nothing runs") {
  OperationQueue queue;  // no communication thread: only run_if_next can run tasks
  Work a(OpType::AllReduce, 0), b(OpType::AllReduce, 1);
  Log log;
  REQUIRE(queue.push({&a, [&] { log.add(0); }}));
  REQUIRE(queue.push({&b, [&] { log.add(1); }}));
  CHECK_FALSE(queue.run_if_next(&b));  // not next: issue order comes first
  CHECK(log.order().empty());
  CHECK(queue.run_if_next(&a));
  CHECK_FALSE(queue.run_if_next(&a));  // already ran
  CHECK(queue.run_if_next(&b));
  REQUIRE(log.order() == std::vector<int>{0, 1});
  CHECK(log.ran[0].second == std::this_thread::get_id());
}

TEST_CASE("operation queue: no waiter starts a task while another one runs") {
  auto queue = std::make_shared<OperationQueue>();
  std::thread comm([queue] { queue->run_until_closed(); });
  Work slow(OpType::Barrier, 0), next(OpType::Barrier, 1);
  std::promise<void> started, release;
  auto release_future = release.get_future().share();
  std::atomic<int> running{0}, most_at_once{0};
  auto body = [&](bool is_slow) {
    const int now = ++running;
    most_at_once = std::max(most_at_once.load(), now);
    if (is_slow) {
      started.set_value();
      release_future.wait();
    }
    --running;
  };
  REQUIRE(queue->push({&slow, [&] { body(true); }}));
  started.get_future().wait();  // the communication thread is inside `slow`
  REQUIRE(queue->push({&next, [&] { body(false); }}));
  CHECK_FALSE(queue->run_if_next(&next));  // next in line, but `slow` is running
  release.set_value();
  queue->close();
  comm.join();  // runs `next` before returning
  CHECK(most_at_once == 1);
  CHECK(running == 0);
}

TEST_CASE("operation queue: the communication thread runs unwaited tasks in order and drains at close") {
  auto queue = std::make_shared<OperationQueue>();
  Log log;
  std::vector<std::unique_ptr<Work>> works;
  for (int i = 0; i < 50; ++i) {
    works.push_back(std::make_unique<Work>(OpType::AllReduce, i));
    REQUIRE(queue->push({works.back().get(), [&log, i] { log.add(i); }}));
  }
  std::thread comm([queue] { queue->run_until_closed(); });
  // A waiter racing the communication thread for a task in the middle.
  queue->run_if_next(works[25].get());
  queue->close();
  comm.join();
  std::vector<int> expected(50);
  for (int i = 0; i < 50; ++i) expected[i] = i;
  CHECK(log.order() == expected);
  CHECK_FALSE(queue->push({works[0].get(), [] {}}));  // closed
}

TEST_CASE("operation queue: a waiter that ran a task hands later ones to the communication thread") {
  auto queue = std::make_shared<OperationQueue>();
  Log log;
  Work first(OpType::AllReduce, 0), second(OpType::AllReduce, 1);
  std::promise<void> first_started, release_first;
  auto release = release_first.get_future().share();
  // Nothing wakes the communication thread before both tasks are queued and the first
  // is claimed: it is started only afterwards.
  REQUIRE(queue->push({&first, [&] {
                         log.add(0);
                         first_started.set_value();
                         release.wait();
                       }}));
  std::thread waiter([&] { CHECK(queue->run_if_next(&first)); });
  first_started.get_future().wait();
  REQUIRE(queue->push({&second, [&] { log.add(1); }}));
  std::thread comm([queue] { queue->run_until_closed(); });
  release_first.set_value();
  waiter.join();
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (log.order().size() < 2 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  REQUIRE(log.order() == std::vector<int>{0, 1});
  CHECK(log.ran[0].second != log.ran[1].second);  // the second ran on the communication thread
  queue->close();
  comm.join();
}
