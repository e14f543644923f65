package io.cmroot.core;

/**
 * The static conf of the engine application running in this JVM (Spark's SparkConf), if
 * one is: there the cmroot settings are the application's, never a session's. The engine's
 * module registers itself ({@code io.cmroot.spark.SparkAppConf}); a metastore without Spark
 * has none, and its settings come from its Hadoop conf (hive-site.xml).
 */
public interface AppConf {
  /** `key` of the application's conf; null when unset. */
  String get(String key);

  /** Is an application running (its conf readable now)? */
  boolean running();

  /** The registered application conf. */
  final class Registry {
    private static volatile AppConf conf;
    private static volatile boolean looked;

    private Registry() {}

    /** Called by the engine module when it loads. */
    public static void register(AppConf c) {
      conf = c;
    }

    /** The application conf, or null without an engine module in this JVM. */
    static AppConf current() {
      AppConf c = conf;
      if (c != null || looked) {
        return c;
      }
      synchronized (Registry.class) {
        if (!looked) {
          try {
            // Loading the Spark module's class registers it; absent outside Spark.
            Class.forName("io.cmroot.spark.SparkAppConf", true,
                AppConf.class.getClassLoader());
          } catch (ClassNotFoundException | LinkageError e) {
            // no Spark module on the class path
          }
          looked = true;
        }
      }
      return conf;
    }

    /** Is an engine application running in this JVM? */
    static boolean running() {
      AppConf c = current();
      return c != null && c.running();
    }

    /** `key` of its conf, or null. */
    static String get(String key) {
      AppConf c = current();
      return c == null ? null : c.get(key);
    }
  }
}
