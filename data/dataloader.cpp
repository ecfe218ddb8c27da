#include "data/dataloader.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <mutex>

#include "core/error.h"
#include "data/random.h"
#include "tensor/cuda_devices.h"

namespace mtrain::data {
namespace {

void check_options(const DataLoaderOptions& o, const Dataset& dataset) {
  if (o.batch_size < 1) {
    throw InvalidArgument(fmt::format("DataLoader: expected batch_size >= 1, found {}",
                                      o.batch_size));
  }
  if (o.num_workers < 1) {
    throw InvalidArgument(fmt::format("DataLoader: expected num_workers >= 1, found {}",
                                      o.num_workers));
  }
  if (o.prefetch_depth < 1) {
    throw InvalidArgument(fmt::format("DataLoader: expected prefetch_depth >= 1, found {}",
                                      o.prefetch_depth));
  }
  if (o.mean.size() != o.std.size()) {
    throw InvalidArgument(fmt::format(
        "DataLoader: expected as many mean values as std values, found {} and {}",
        o.mean.size(), o.std.size()));
  }
  const size_t channels = static_cast<size_t>(dataset.channels());
  if (!o.mean.empty() && o.mean.size() != 1 && o.mean.size() != channels) {
    throw InvalidArgument(fmt::format(
        "DataLoader: expected 1 or {} normalisation values (one per channel of {}), found {}",
        channels, dataset.name(), o.mean.size()));
  }
  for (float s : o.std) {
    if (!(s > 0.0f)) {
      throw InvalidArgument(fmt::format("DataLoader: expected std values > 0, found {}", s));
    }
  }
  if (o.augment.crop_padding > std::max(dataset.height(), dataset.width())) {
    throw InvalidArgument(fmt::format(
        "DataLoader: expected a crop padding of at most {} (the side of {}'s images), found {}",
        std::max(dataset.height(), dataset.width()), dataset.name(), o.augment.crop_padding));
  }
  if (!o.batch_sizes.empty() && o.drop_last) {
    throw InvalidArgument(
        "DataLoader: expected drop_last = false with per-step batch_sizes (the sampler decides "
        "what to drop), found drop_last = true");
  }
  for (size_t k = 0; k < o.batch_sizes.size(); ++k) {
    if (o.batch_sizes[k] < 0) {
      throw InvalidArgument(fmt::format(
          "DataLoader: expected batch_sizes >= 0, found {} at step {}", o.batch_sizes[k], k));
    }
  }
  if (o.pin_memory && cuda_info().device_count == 0) {
    throw InvalidArgument(fmt::format(
        "DataLoader: pin_memory needs a usable GPU (pinned host memory is allocated through "
        "CUDA), found {}; leave pin_memory off when training on the CPU",
        cuda_summary()));
  }
}

// Prefix sums of the per-step sizes: batch k covers [starts[k], starts[k + 1]).
std::vector<int64_t> batch_starts(const std::vector<int64_t>& sizes) {
  if (sizes.empty()) return {};
  std::vector<int64_t> starts(sizes.size() + 1, 0);
  for (size_t k = 0; k < sizes.size(); ++k) starts[k + 1] = starts[k] + sizes[k];
  return starts;
}

// Per channel, the float value of each possible pixel byte; see Note [DataLoader
// prefetch and order] for why the arithmetic mirrors ToTensor + Normalize.
std::vector<std::vector<float>> make_pixel_tables(const DataLoaderOptions& o, int64_t channels) {
  std::vector<std::vector<float>> tables(static_cast<size_t>(channels), std::vector<float>(256));
  for (size_t c = 0; c < tables.size(); ++c) {
    for (int p = 0; p < 256; ++p) {
      float x = static_cast<float>(p) / 255.0f;
      if (!o.mean.empty()) {
        const size_t k = o.mean.size() == 1 ? 0 : c;
        x = (x - o.mean[k]) / o.std[k];
      }
      tables[c][static_cast<size_t>(p)] = x;
    }
  }
  return tables;
}

// One row of an augmented batch: out(c, y, x) = padded(c, y + top, x' + left), x' the
// mirrored column when flipped, padded = the image with `pad` zero bytes on every side;
// then the channel's table (ToTensor and Normalize). Row by row: the columns that fall in
// the padding are filled, the rest read the source row forwards or backwards.
void augmented_row(const uint8_t* pixels, int64_t channels, int64_t h, int64_t w, int64_t pad,
                   const AugmentationDraw& d, const std::vector<std::vector<float>>& tables, float* out) {
  // Output column x reads source column s0 + x (s0 - x flipped); the part of the row inside the
  // image is x in [x0, x1).
  const int64_t s0 = d.flip ? w - 1 + d.left - pad : d.left - pad;
  const int64_t x0 = std::clamp<int64_t>(d.flip ? s0 - (w - 1) : -s0, 0, w);
  const int64_t x1 = std::clamp<int64_t>(d.flip ? s0 + 1 : w - s0, x0, w);
  for (int64_t c = 0; c < channels; ++c) {
    const float* table = tables[static_cast<size_t>(c)].data();
    const uint8_t* plane = pixels + c * h * w;
    for (int64_t y = 0; y < h; ++y) {
      float* row = out + (c * h + y) * w;
      const int64_t sy = y + d.top - pad;
      if (sy < 0 || sy >= h) {
        std::fill(row, row + w, table[0]);
        continue;
      }
      const uint8_t* line = plane + sy * w;
      std::fill(row, row + x0, table[0]);
      if (d.flip) {
        for (int64_t x = x0; x < x1; ++x) row[x] = table[line[s0 - x]];
      } else {
        for (int64_t x = x0; x < x1; ++x) row[x] = table[line[s0 + x]];
      }
      std::fill(row + x1, row + w, table[0]);
    }
  }
}

// Note [Decoding without page faults]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A streamed set's workers decode, crop and resample every image into fresh buffers of a few
// hundred KB. glibc serves such sizes from mmap at first, and returns freed heap tops to
// the system, so the same memory was faulted in and zeroed again image after image: a sixth
// of the decoding time (docs/benchmarks.md). Once a process streams, blocks below 32 MiB
// come from the heap and up to 128 MiB of free heap is kept (per thread's arena: a few
// MB in practice, the images' working set). Tensors have their own cache and are unaffected.
// The RandomResizedCrop path goes further and keeps its buffers per thread, so they are not
// even zero-filled again (crop_buffers in image_decode.cpp).
void keep_decode_buffers() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Advice to the allocator: a failure only costs the page faults back.
    (void)mallopt(M_MMAP_THRESHOLD, 32 << 20);
    (void)mallopt(M_TRIM_THRESHOLD, 128 << 20);
  });
}

}  // namespace

// Note [Augmentation draws]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// torchvision draws from a generator that advances as images are transformed, so what an
// image gets depends on which worker took it and when. Here each image's draw is a hash of
// (seed, epoch, dataset index): the same batches whatever the number of workers, one rank's
// images transformed as a single process would transform them (so 2 ranks still equal 1
// rank with the doubled batch), a new draw every epoch, and a run resumed mid-epoch draws
// what the uninterrupted run drew. Ranks read different images, so their streams differ.
// The top and left offsets take 24 bits each, uniform over [0, 2 * padding] up to a
// modulo bias of (2 * padding + 1) / 2^24; the flip is the top bit.
AugmentationDraw augmentation_draw(const Augmentation& a, int64_t epoch, int64_t index) {
  const uint64_t h = mix64(mix64(mix64(a.seed) ^ static_cast<uint64_t>(epoch)) ^ static_cast<uint64_t>(index));
  AugmentationDraw d;
  if (a.crop_padding > 0) {
    const auto span = static_cast<uint64_t>(2 * a.crop_padding + 1);
    d.top = static_cast<int64_t>((h & 0xFFFFFF) % span);
    d.left = static_cast<int64_t>(((h >> 24) & 0xFFFFFF) % span);
  }
  d.flip = a.horizontal_flip && ((h >> 63) & 1u) != 0;
  return d;
}

ChannelStats channel_stats(const Dataset& dataset) {
  const int64_t channels = dataset.channels(), plane = dataset.height() * dataset.width();
  std::vector<std::vector<int64_t>> counts(static_cast<size_t>(channels), std::vector<int64_t>(256, 0));
  const uint8_t* p = dataset.pixels().data();
  for (int64_t i = 0; i < dataset.size(); ++i) {
    for (int64_t c = 0; c < channels; ++c) {
      std::vector<int64_t>& hist = counts[static_cast<size_t>(c)];
      const uint8_t* row = p + (i * channels + c) * plane;
      for (int64_t k = 0; k < plane; ++k) ++hist[row[k]];
    }
  }
  ChannelStats stats;
  for (const std::vector<int64_t>& hist : counts) {
    double n = 0, sum = 0;
    for (int v = 0; v < 256; ++v) {
      n += static_cast<double>(hist[static_cast<size_t>(v)]);
      sum += static_cast<double>(hist[static_cast<size_t>(v)]) * v / 255.0;
    }
    const double mean = n > 0 ? sum / n : 0.0;
    double var = 0;
    for (int v = 0; v < 256; ++v) {
      const double d = v / 255.0 - mean;
      var += static_cast<double>(hist[static_cast<size_t>(v)]) * d * d;
    }
    stats.mean.push_back(static_cast<float>(mean));
    stats.std.push_back(static_cast<float>(n > 0 ? std::sqrt(var / n) : 0.0));
  }
  return stats;
}

// Note [DataLoader prefetch and order]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Batch k of an epoch is a pure function of (epoch order, k): workers claim batch numbers in
// increasing order, assemble them without holding the lock, and park the result under its number;
// next() hands out number f, f + 1, ... from the epoch's first batch f (0 unless a resumed run
// passes over the batches it trained on) and waits for the one it needs. So the batches are
// identical and in the same order for any number of workers. Workers may claim batch k only while
// k < (next batch to hand out) + prefetch_depth, which bounds memory to prefetch_depth batches and
// means the consumer never waits when assembly keeps up. start_epoch bumps a generation counter:
// batches of an abandoned epoch that are still being assembled are dropped when they arrive, so an
// epoch can be restarted (or the loader destroyed) at any point. An exception inside a worker is
// stored in place of its batch and rethrown by next() when that batch is due; the epoch then stops
// and next() keeps rethrowing it until the next start_epoch. The destructor stops and joins the
// workers; they check for it between batches, so it never waits for more than the batch each is
// assembling. next() and start_epoch are meant to be called from one consumer thread.
//
// With pin_memory the images and labels live in pinned host memory from the caching pinned
// allocator (tensor/cuda_memory.h); a consumer copying them asynchronously to a GPU declares the
// copy with record_stream (Tensor::copy_ with non_blocking does), so a batch's block is not
// refilled by a worker before its copy has read it.
//
// Pixels become float32 exactly like torchvision's ToTensor() then Normalize(mean, std):
// x = (p / 255 - mean[c]) / std[c], computed in float32 through a 256-entry table per channel.
// With no mean/std the values are p / 255 in [0, 1] (d2l's default).
DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, std::shared_ptr<Sampler> sampler,
                       DataLoaderOptions options)
    : dataset_(std::move(dataset)), sampler_(std::move(sampler)), options_(std::move(options)) {
  if (!dataset_ || !sampler_) {
    throw InvalidArgument("DataLoader: expected a dataset and a sampler, found a null pointer");
  }
  check_options(options_, *dataset_);
  if (!dataset_->in_memory()) keep_decode_buffers();
  pixel_tables_ = make_pixel_tables(options_, dataset_->channels());
  if (options_.drop_last && !sampler_->batch_sizes().empty()) {
    throw InvalidArgument(fmt::format(
        "DataLoader: expected drop_last = false with sampler '{}', which decides each step's batch size (and what "
        "to drop), found drop_last = true",
        sampler_->describe()));
  }
  workers_.reserve(static_cast<size_t>(options_.num_workers));
  try {
    for (int i = 0; i < options_.num_workers; ++i) {
      workers_.emplace_back([this] {
        // Pinned batches are allocated here (Note [Helper threads and the process's GPU]).
        if (options_.pin_memory) adopt_process_device();
        worker_loop();
      });
    }
  } catch (...) {
    // The destructor does not run for a throwing constructor, and destroying a joinable
    // std::thread calls std::terminate: stop the workers already started first.
    stop_workers();
    throw;
  }
}

DataLoader::~DataLoader() { stop_workers(); }

void DataLoader::stop_workers() noexcept {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

std::vector<int64_t> DataLoader::planned_sizes() const {
  return options_.batch_sizes.empty() ? sampler_->batch_sizes() : options_.batch_sizes;
}

int64_t DataLoader::batches_for(int64_t items) const {
  if (const std::vector<int64_t> sizes = planned_sizes(); !sizes.empty()) return static_cast<int64_t>(sizes.size());
  const int64_t b = options_.batch_size;
  return options_.drop_last ? items / b : (items + b - 1) / b;
}

int64_t DataLoader::num_batches() const { return batches_for(sampler_->size()); }

std::shared_ptr<const DataLoader::Plan> DataLoader::make_plan() const {
  auto plan = std::make_shared<Plan>();
  plan->order = sampler_->indices();
  plan->sampler_description = sampler_->describe();
  if (static_cast<int64_t>(plan->order.size()) != sampler_->size()) {
    throw InternalError(fmt::format("sampler '{}' returned {} indices but says its size is {}",
                                    plan->sampler_description, plan->order.size(), sampler_->size()));
  }
  const std::vector<int64_t> sizes = planned_sizes();
  plan->starts = batch_starts(sizes);
  if (!plan->starts.empty() && plan->starts.back() != static_cast<int64_t>(plan->order.size())) {
    throw InvalidArgument(fmt::format(
        "DataLoader: expected the {} per-step batch sizes to sum to the {} items of sampler "
        "'{}', found a sum of {}",
        sizes.size(), plan->order.size(), plan->sampler_description, plan->starts.back()));
  }
  return plan;
}

void DataLoader::start_epoch(int64_t epoch, int64_t first_batch) {
  if (first_batch < 0) {
    throw InvalidArgument(fmt::format("DataLoader::start_epoch: expected a first batch >= 0, found {}", first_batch));
  }
  sampler_->set_epoch(epoch);
  std::shared_ptr<const Plan> plan = make_plan();
  const int64_t batches = batches_for(static_cast<int64_t>(plan->order.size()));
  std::map<int64_t, Slot> abandoned;
  {
    std::lock_guard lock(mutex_);
    ++generation_;
    epoch_started_ = true;
    epoch_ = epoch;
    plan_ = std::move(plan);
    replan_from_.clear();
    epoch_batches_ = batches;
    next_to_claim_ = std::min(first_batch, batches);
    next_to_hand_out_ = next_to_claim_;
    abandoned.swap(ready_);  // freed outside the lock
    epoch_error_ = nullptr;
  }
  work_cv_.notify_all();
}

// Note [Re-planning an epoch]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// --balance moves the boundaries between the ranks' chunks of later steps while an epoch runs
// (Note [Shares that change mid-epoch] in distributed_sampler.cpp), after workers may already have
// assembled some of those batches. replan builds a new plan from the sampler and makes batch
// from_batch the next to claim; batches before it keep their slots. A batch assembled from an
// older plan is kept only if no re-plan since its claim reached down to its number (a batch k is
// unchanged by every re-plan from a batch > k): its claim remembers how many re-plans the epoch had
// seen, and replan_from_ lists where each began. Batches at or after from_batch that were ready
// are dropped and assembled again: a few per re-plan, and re-plans are rare (hysteresis).
void DataLoader::replan(int64_t from_batch) {
  if (!options_.batch_sizes.empty() || sampler_->batch_sizes().empty()) {
    throw InvalidArgument(fmt::format(
        "DataLoader::replan: expected a sampler that decides each step's batch size and no fixed batch_sizes, "
        "found sampler '{}'{}",
        sampler_->describe(), options_.batch_sizes.empty() ? "" : " with fixed batch_sizes"));
  }
  std::shared_ptr<const Plan> plan = make_plan();
  const int64_t batches = batches_for(static_cast<int64_t>(plan->order.size()));
  std::map<int64_t, Slot> dropped;
  {
    std::lock_guard lock(mutex_);
    MTRAIN_CHECK(epoch_started_, "DataLoader::replan() called before start_epoch()");
    if (epoch_error_) return;  // the epoch ends at its error, which next() rethrows
    if (from_batch < next_to_hand_out_ || batches != epoch_batches_) {
      throw InvalidArgument(fmt::format(
          "DataLoader::replan: expected a batch not yet handed out (>= {}) and {} batches, found batch {} and {} "
          "batches",
          next_to_hand_out_, epoch_batches_, from_batch, batches));
    }
    plan_ = std::move(plan);
    replan_from_.push_back(from_batch);
    next_to_claim_ = std::min(next_to_claim_, from_batch);
    for (auto it = ready_.lower_bound(from_batch); it != ready_.end();) {
      dropped.insert(ready_.extract(it++));
    }
  }
  work_cv_.notify_all();
}

std::optional<Batch> DataLoader::next() {
  Slot slot;
  {
    std::unique_lock lock(mutex_);
    MTRAIN_CHECK(epoch_started_, "DataLoader::next() called before start_epoch()");
    if (epoch_error_) std::rethrow_exception(epoch_error_);
    if (next_to_hand_out_ >= epoch_batches_) return std::nullopt;
    const int64_t wanted = next_to_hand_out_;
    ready_cv_.wait(lock, [&] { return ready_.count(wanted) != 0; });
    auto node = ready_.extract(wanted);
    slot = std::move(node.mapped());
    ++next_to_hand_out_;
    if (slot.error) {
      // The epoch stops here: later batches would be handed out of a broken epoch.
      epoch_error_ = slot.error;
      epoch_batches_ = next_to_hand_out_;
      ready_.clear();
    }
  }
  work_cv_.notify_all();  // one more batch may now be claimed
  if (slot.error) std::rethrow_exception(slot.error);
  return std::move(slot.batch);
}

bool DataLoader::can_claim() const {
  return epoch_started_ && next_to_claim_ < epoch_batches_ &&
         next_to_claim_ < next_to_hand_out_ + options_.prefetch_depth;
}

void DataLoader::worker_loop() {
  std::unique_lock lock(mutex_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stop_ || can_claim(); });
    if (stop_) return;
    const int64_t batch_index = next_to_claim_++;
    const uint64_t generation = generation_;
    const size_t replans = replan_from_.size();
    const int64_t epoch = epoch_;
    const std::shared_ptr<const Plan> plan = plan_;
    lock.unlock();

    Slot slot;
    try {
      slot.batch = assemble(epoch, batch_index, *plan);
    } catch (...) {
      slot.error = std::current_exception();
    }

    lock.lock();
    // Note [Re-planning an epoch]: a later plan may have changed this batch.
    bool current = generation == generation_ && !epoch_error_;
    for (size_t v = replans; current && v < replan_from_.size(); ++v) current = batch_index < replan_from_[v];
    if (current) {
      ready_.emplace(batch_index, std::move(slot));
      produced_.fetch_add(1);
      ready_cv_.notify_all();
    } else {
      // An abandoned epoch's batch: free it without holding up the others.
      lock.unlock();
      slot = Slot{};
      lock.lock();
    }
  }
}

Batch DataLoader::assemble(int64_t epoch, int64_t batch_index, const Plan& plan) const {
  const std::vector<int64_t>& order = plan.order;
  const std::string& sampler_description = plan.sampler_description;
  int64_t begin = 0;
  int64_t end = 0;
  if (plan.starts.empty()) {
    begin = batch_index * options_.batch_size;
    end = std::min<int64_t>(begin + options_.batch_size, static_cast<int64_t>(order.size()));
  } else {
    begin = plan.starts[static_cast<size_t>(batch_index)];
    end = plan.starts[static_cast<size_t>(batch_index) + 1];
  }
  const Dataset& ds = *dataset_;
  const int64_t rows = end - begin;
  const int64_t plane = ds.height() * ds.width();

  Batch batch;
  batch.epoch = epoch;
  batch.batch_index = batch_index;
  batch.indices.assign(order.begin() + begin, order.begin() + end);
  batch.images = batch_tensor({rows, ds.channels(), ds.height(), ds.width()}, DType::Float32);
  batch.labels = batch_tensor({rows}, DType::Int64);
  float* images = batch.images.data<float>();
  int64_t* labels = batch.labels.data<int64_t>();
  std::vector<uint8_t> decoded(ds.in_memory() ? 0 : static_cast<size_t>(ds.shape().numel()));
  int64_t kept = 0;  // rows written; fewer than `rows` when bad images are left out
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t index = batch.indices[static_cast<size_t>(r)];
    if (index < 0 || index >= ds.size()) {
      throw InternalError(fmt::format(
          "sampler '{}' produced index {} (epoch {}, batch {}) for dataset {} of {} items",
          sampler_description, index, epoch, batch_index, ds.name(), ds.size()));
    }
    const uint8_t* pixels = nullptr;
    if (ds.in_memory()) {
      pixels = ds.image(index);
    } else {
      try {
        ds.read_image(index, epoch, decoded.data());
      } catch (const IoError& e) {
        if (!options_.skip_bad_images) throw;
        note_left_out(e.what());
        continue;
      }
      pixels = decoded.data();
    }
    float* out = images + kept * ds.channels() * plane;
    labels[kept] = ds.label(index);
    batch.indices[static_cast<size_t>(kept++)] = index;
    if (options_.augment.active()) {
      augmented_row(pixels, ds.channels(), ds.height(), ds.width(), std::max<int64_t>(options_.augment.crop_padding, 0),
                    augmentation_draw(options_.augment, epoch, index), pixel_tables_, out);
      continue;
    }
    for (int64_t c = 0; c < ds.channels(); ++c) {
      const float* table = pixel_tables_[static_cast<size_t>(c)].data();
      for (int64_t p = 0; p < plane; ++p) out[c * plane + p] = table[pixels[c * plane + p]];
    }
  }
  if (kept < rows) shrink(batch, kept);
  return batch;
}

void DataLoader::note_left_out(const std::string& reason) const {
  std::lock_guard lock(left_out_mutex_);
  if (left_out_ == 0) first_left_out_ = reason;
  ++left_out_;
}

std::pair<int64_t, std::string> DataLoader::images_left_out() const {
  std::lock_guard lock(left_out_mutex_);
  return {left_out_, first_left_out_};
}

Tensor DataLoader::batch_tensor(const Shape& shape, DType dtype) const {
  return options_.pin_memory ? Tensor::empty_pinned(shape, dtype) : Tensor::empty(shape, dtype);
}

// Note [Images left out of a batch]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A streamed image is decoded only when its batch is assembled, so a corrupt one is found
// mid-epoch. Under --skip-bad-images it is left out of its batch, which is one row short;
// the ranks still take the same steps (a batch of any size, even 0, is a step), so no
// collective waits for a rank that skipped. The images keep their first rows' order.
void DataLoader::shrink(Batch& batch, int64_t rows) const {
  const Shape image_shape{rows, batch.images.shape()[1], batch.images.shape()[2], batch.images.shape()[3]};
  Tensor images = batch_tensor(image_shape, DType::Float32);
  Tensor labels = batch_tensor({rows}, DType::Int64);
  const int64_t row = image_shape[1] * image_shape[2] * image_shape[3];
  std::copy_n(batch.images.data<float>(), rows * row, images.data<float>());
  std::copy_n(batch.labels.data<int64_t>(), rows, labels.data<int64_t>());
  batch.images = std::move(images);
  batch.labels = std::move(labels);
  batch.indices.resize(static_cast<size_t>(rows));
}

std::string DataLoader::describe() const {
  std::string augmentation;
  if (options_.augment.crop_padding >= 0) {
    augmentation += fmt::format("random crop (padding {}), ", options_.augment.crop_padding);
  }
  if (options_.augment.horizontal_flip) augmentation += "random horizontal flip, ";
  std::string normalisation = augmentation +
      (options_.mean.empty()
          ? std::string("pixels/255")
          : fmt::format("(pixels/255 - {}) / {}", fmt::join(options_.mean, ","),
                        fmt::join(options_.std, ",")));
  const std::vector<int64_t> sizes = planned_sizes();
  const std::string batching =
      sizes.empty() ? fmt::format("batch {}{}", options_.batch_size, options_.drop_last ? " (drop last)" : "")
                    : fmt::format("{} per-step batch sizes", sizes.size());
  return fmt::format("{}, {} worker(s), prefetch {}{}, {}, {}", batching, options_.num_workers,
                     options_.prefetch_depth, options_.pin_memory ? ", pinned" : "", normalisation,
                     sampler_->describe());
}

}  // namespace mtrain::data
