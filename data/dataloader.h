// DataLoader: cuts a sampler's epoch order into batches and assembles them as Tensors on
// background threads, ahead of the training loop.
//
//   DataLoader loader(dataset, sampler, {.batch_size = 64, .num_workers = 2});
//   for (int64_t e = 0; e < epochs; ++e) {
//     loader.start_epoch(e);                      // sampler.set_epoch(e), prefetch starts
//     while (auto batch = loader.next()) { ... }  // batch->images, batch->labels
//   }
//
// Batches are identical and in the same order for any number of workers; at most
// prefetch_depth batches are held ahead of the consumer; a worker's exception is rethrown by
// next() when its batch is due (Note [DataLoader prefetch and order] in dataloader.cpp).
// next() and start_epoch must be called from one consumer thread. Pixels become float32 as
// torchvision's ToTensor() then Normalize(mean, std): x = (p / 255 - mean[c]) / std[c],
// after the optional random crop and flip (Augmentation).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "data/dataset.h"
#include "data/sampler.h"
#include "tensor/tensor.h"

namespace mtrain::data {

// torchvision's RandomCrop(size = the image's, padding) then RandomHorizontalFlip(0.5),
// applied to the uint8 image before ToTensor and Normalize (the usual CIFAR recipe). Each
// image's draw depends only on (seed, epoch, dataset index): the same for any number of
// workers or ranks, different from epoch to epoch, and a resumed run draws what the
// uninterrupted one would (Note [Augmentation draws] in dataloader.cpp).
struct Augmentation {
  int64_t crop_padding = -1;   // < 0: no random crop; else zero padding on every side
  bool horizontal_flip = false;
  uint64_t seed = 0;

  bool active() const { return crop_padding >= 0 || horizontal_flip; }
};

// One image's draw: the crop's top-left corner in the padded image ([0, 2 * padding]
// each) and whether it is mirrored. Exposed so tests can compute the expected image.
struct AugmentationDraw {
  int64_t top = 0;
  int64_t left = 0;
  bool flip = false;
};
AugmentationDraw augmentation_draw(const Augmentation& a, int64_t epoch, int64_t index);

// Per-channel mean and (population) standard deviation of a dataset's pixels / 255, as
// the "auto" normalisation computes them once over the training set.
struct ChannelStats {
  std::vector<float> mean;
  std::vector<float> std;
};
ChannelStats channel_stats(const Dataset& dataset);

struct DataLoaderOptions {
  int64_t batch_size = 64;
  bool drop_last = false;   // drop the last partial batch of an epoch
  int num_workers = 2;      // threads assembling batches (>= 1)
  int prefetch_depth = 2;   // batches assembled ahead of the consumer (>= 1)
  // Per-channel normalisation: empty (none), one value for every channel, or one per
  // channel. mean and std must have the same length; std values must be > 0.
  std::vector<float> mean{};
  std::vector<float> std{};
  // Per-step batch sizes: batch k has batch_sizes[k] rows, 0 allowed (a 0-row Batch is
  // still handed out, so a rank with nothing to do at a step still takes it). Empty: the
  // sampler's batch_sizes() when it has them (GlobalBatchShardSampler), else batch_size
  // rows per batch. Per-step sizes must sum to the sampler's size and drop_last must be
  // false (the sampler already decided what to drop); batch_size is then unused.
  std::vector<int64_t> batch_sizes{};
  // Assemble batches straight into pinned host memory (torch's pin_memory), so that their
  // copy to a GPU can be asynchronous (data/device_prefetcher.h). Pinned memory comes from
  // CUDA: without a usable GPU this is InvalidArgument at construction.
  bool pin_memory = false;
  // Random crop and flip, per image (none by default; an evaluation loader takes none).
  Augmentation augment{};
  // A streamed image that does not decode is left out of its batch and counted
  // (images_left_out) instead of failing the batch (Note [Images left out of a batch]).
  bool skip_bad_images = false;
};

struct Batch {
  Tensor images;                 // float32 [B, C, H, W]
  Tensor labels;                 // int64 [B]
  std::vector<int64_t> indices;  // dataset index of each row
  int64_t epoch = 0;
  int64_t batch_index = 0;       // position within the epoch

  int64_t size() const { return static_cast<int64_t>(indices.size()); }
};

class DataLoader {
 public:
  // Throws InvalidArgument for bad options. The sampler must index `dataset`.
  DataLoader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<Sampler> sampler,
             DataLoaderOptions options);
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // Sets the sampler's epoch, abandons any unfinished epoch and starts prefetching at batch
  // min(first_batch, num_batches()): the batches before it are passed over, never assembled
  // (a run resumed mid-epoch), and next() hands out that batch first.
  void start_epoch(int64_t epoch, int64_t first_batch = 0);
  // The next batch of the epoch, nullopt after the last one. Rethrows a worker's error.
  std::optional<Batch> next();
  // Re-reads the sampler's order and per-step sizes after it changed the split of batch
  // `from_batch` and later ones of this epoch (Note [Re-planning an epoch]); batches
  // before it stay as planned. The sampler must cut its batches by its own batch_sizes()
  // with the same number of batches; from_batch must not have been handed out yet
  // (InvalidArgument otherwise).
  void replan(int64_t from_batch);

  // Batches per epoch for the sampler's current size.
  int64_t num_batches() const;
  const Dataset& dataset() const { return *dataset_; }
  Sampler& sampler() const { return *sampler_; }
  const DataLoaderOptions& options() const { return options_; }
  // Batches finished by workers since construction (those of abandoned epochs excluded).
  uint64_t batches_produced() const { return produced_.load(); }
  // Streamed images left out under skip_bad_images since construction, and why the first was.
  std::pair<int64_t, std::string> images_left_out() const;
  // One line for logs: batch size, workers, prefetch, pinning, normalisation, sampler.
  std::string describe() const;

 private:
  struct Slot {
    std::optional<Batch> batch;
    std::exception_ptr error;
  };
  // What workers read to assemble the epoch's batches; replaced whole, never changed.
  struct Plan {
    std::vector<int64_t> order;
    std::vector<int64_t> starts;  // per-step sizes: batch k is [starts[k], starts[k+1]); else empty
    std::string sampler_description;  // for workers' messages (the sampler is not theirs)
  };

  std::vector<int64_t> planned_sizes() const;  // per-step sizes, or empty
  std::shared_ptr<const Plan> make_plan() const;
  int64_t batches_for(int64_t items) const;  // honours drop_last and per-step sizes
  void stop_workers() noexcept;               // tells every worker to stop and joins it
  void worker_loop();
  bool can_claim() const;  // requires mutex_
  // Runs on a worker thread: reads only the dataset, the tables and its arguments.
  Batch assemble(int64_t epoch, int64_t batch_index, const Plan& plan) const;
  void shrink(Batch& batch, int64_t rows) const;  // keeps the first `rows` rows
  Tensor batch_tensor(const Shape& shape, DType dtype) const;  // in pinned memory with pin_memory
  void note_left_out(const std::string& reason) const;

  std::shared_ptr<const Dataset> dataset_;
  std::shared_ptr<Sampler> sampler_;
  DataLoaderOptions options_;
  std::vector<std::vector<float>> pixel_tables_;  // [channel][0..255] -> float value

  mutable std::mutex mutex_;
  std::condition_variable work_cv_;   // workers: a batch can be claimed, or stop
  std::condition_variable ready_cv_;  // consumer: a batch arrived
  bool stop_ = false;
  bool epoch_started_ = false;
  uint64_t generation_ = 0;
  int64_t epoch_ = 0;
  std::shared_ptr<const Plan> plan_;
  // Note [Re-planning an epoch]: replan_from_[v] is the first batch that re-plan v + 1 of
  // this epoch changed.
  std::vector<int64_t> replan_from_;
  int64_t epoch_batches_ = 0;
  int64_t next_to_claim_ = 0;
  int64_t next_to_hand_out_ = 0;
  std::map<int64_t, Slot> ready_;
  std::exception_ptr epoch_error_;
  std::atomic<uint64_t> produced_{0};
  mutable std::mutex left_out_mutex_;
  mutable int64_t left_out_ = 0;
  mutable std::string first_left_out_;

  std::vector<std::thread> workers_;  // last: started after everything they read
};

}  // namespace mtrain::data
